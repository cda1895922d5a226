//! `redis::FromRedisValue` for the reply types (feature `redis`), through
//! `Frame`, so redis-rs users read replies with the same code as the tests.

use redis::{FromRedisValue, ParsingError, Value};

use super::{parse_pull_batch, parse_record, BeginReply, Frame, PulledRecord, WireError};
use crate::Record;

/// A copy of the value (`From<Value>` moves instead).
impl From<&Value> for Frame {
    fn from(v: &Value) -> Frame {
        Frame::from(v.clone())
    }
}

/// A redis-rs value as a `Frame`, moving strings and arrays, not copying.
impl From<Value> for Frame {
    fn from(v: Value) -> Frame {
        match v {
            Value::Int(i) => Frame::Int(i),
            Value::BulkString(b) => Frame::Bulk(b),
            Value::SimpleString(s) => Frame::Simple(s),
            Value::Okay => Frame::Simple("OK".into()),
            Value::Array(items) | Value::Set(items) => {
                Frame::Array(items.into_iter().map(Frame::from).collect())
            }
            Value::Map(pairs) => Frame::Array(
                pairs
                    .into_iter()
                    .flat_map(|(k, v)| [Frame::from(k), Frame::from(v)])
                    .collect(),
            ),
            Value::Nil => Frame::Null,
            // Verbatim strings, doubles, booleans, ...: not in idem's replies.
            other => Frame::Bulk(format!("{other:?}").into_bytes()),
        }
    }
}

fn type_error(e: WireError) -> ParsingError {
    ParsingError::from(format!("idem reply: {e}"))
}

/// `FromRedisValue` for a reply type, parsed from the value's `Frame`.
macro_rules! from_frame {
    ($ty:ty, $parse:expr) => {
        impl FromRedisValue for $ty {
            fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
                $parse(&Frame::from(v)).map_err(type_error)
            }

            fn from_redis_value_ref(v: &Value) -> Result<Self, ParsingError> {
                $parse(&Frame::from(v)).map_err(type_error)
            }
        }
    };
}

impl FromRedisValue for BeginReply {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        BeginReply::parse_owned(Frame::from(v)).map_err(type_error)
    }

    fn from_redis_value_ref(v: &Value) -> Result<Self, ParsingError> {
        BeginReply::parse(&Frame::from(v)).map_err(type_error)
    }
}

/// An `IDEM.GET` reply (nil or a record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetReply(pub Option<Record>);

from_frame!(GetReply, |f| parse_record(f).map(GetReply));

/// An `IDEM.MIRROR.PULL` reply, each entry parsed on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReply(pub Vec<Result<PulledRecord, WireError>>);

from_frame!(PullReply, |f| parse_pull_batch(f).map(PullReply));
