//! The `idem-recd` module data type: RDB, AOF rewrite, MEMORY USAGE, DEBUG
//! DIGEST, COPY and free callbacks. The encoding itself is `idem_core::codec`.

use std::ffi::c_int;

use idem_core::args::name;
use idem_core::{codec, Record};
use redis_module::native_types::RedisType;

use crate::ffi::ctx::{log_warning, Name};
use crate::ffi::datatype::{methods, ModuleValue};
use crate::ffi::io::{Aof, Rdb};
use crate::mirror;

/// RDB encoding version. Version 1 = one string buffer holding
/// `idem_core::codec` bytes (which carry their own format byte).
const ENCVER: i32 = 1;

pub static IDEM_TYPE: RedisType = RedisType::new("idem-recd", ENCVER, methods::<Record>());

impl ModuleValue for Record {
    fn rdb_load(io: Rdb, encver: c_int) -> Option<Record> {
        if encver != ENCVER {
            log_warning(&format!("idem: unknown RDB encoding version {encver}"));
            return None;
        }
        let buf = io.load_buffer()?;
        match codec::decode(&buf) {
            Ok(rec) => {
                mirror::loaded(io.key_and_db(), &rec, io.is_loading());
                Some(rec)
            }
            Err(e) => {
                log_warning(&format!("idem: {e}"));
                None
            }
        }
    }

    fn rdb_save(&self) -> Vec<u8> {
        codec::encode(self)
    }

    fn aof_rewrite(&self, aof: &Aof, key: Name) {
        aof.emit_key_blob(name::PUT_C, key, &codec::encode(self));
    }

    fn mem_usage(&self) -> usize {
        self.memory_usage()
    }

    fn digest(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// The copy has no row of its own in Postgres: it is pending.
    fn copy_to_another_name(&self) -> Record {
        let mut copy = self.clone();
        copy.mark_pending();
        copy
    }
}
