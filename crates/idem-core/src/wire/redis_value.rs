//! `redis::FromRedisValue` for the reply types (feature `redis`), through
//! `Frame`, so redis-rs users read replies with the same code as the tests.

use redis::{ErrorKind, FromRedisValue, RedisError, RedisResult, Value};

use super::{parse_pull_batch, parse_record, BeginReply, Frame, PulledRecord, WireError};
use crate::Record;

impl From<&Value> for Frame {
    fn from(v: &Value) -> Frame {
        match v {
            Value::Int(i) => Frame::Int(*i),
            Value::BulkString(b) => Frame::Bulk(b.clone()),
            Value::SimpleString(s) => Frame::Simple(s.clone()),
            Value::Okay => Frame::Simple("OK".into()),
            Value::Array(items) | Value::Set(items) => {
                Frame::Array(items.iter().map(Frame::from).collect())
            }
            Value::Map(pairs) => Frame::Array(
                pairs
                    .iter()
                    .flat_map(|(k, v)| [Frame::from(k), Frame::from(v)])
                    .collect(),
            ),
            Value::Nil => Frame::Null,
            // Verbatim strings, doubles, booleans, ...: not in idem's replies.
            other => Frame::Bulk(format!("{other:?}").into_bytes()),
        }
    }
}

fn type_error(e: WireError) -> RedisError {
    RedisError::from((ErrorKind::TypeError, "idem reply", e.to_string()))
}

impl FromRedisValue for BeginReply {
    fn from_redis_value(v: &Value) -> RedisResult<Self> {
        BeginReply::parse(&Frame::from(v)).map_err(type_error)
    }
}

/// An `IDEM.GET` reply (nil or a record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetReply(pub Option<Record>);

impl FromRedisValue for GetReply {
    fn from_redis_value(v: &Value) -> RedisResult<Self> {
        parse_record(&Frame::from(v))
            .map(GetReply)
            .map_err(type_error)
    }
}

/// An `IDEM.MIRROR.PULL` reply, each entry parsed on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReply(pub Vec<Result<PulledRecord, WireError>>);

impl FromRedisValue for PullReply {
    fn from_redis_value(v: &Value) -> RedisResult<Self> {
        parse_pull_batch(&Frame::from(v))
            .map(PullReply)
            .map_err(type_error)
    }
}
