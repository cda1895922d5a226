//! Forged DUMP payloads: the record buffer of a real DUMP (taken with
//! `rdbcompression no`), mutated, re-framed and sealed with a valid RDB
//! version and CRC64, so RESTORE reaches the module's decoder.
//!
//! A module value's DUMP: type byte 7 (RDB_TYPE_MODULE_2), the module type
//! id (0x81 + 8 bytes), opcode 5 (string) + RDB string, opcode 0 (EOF), then
//! the 2-byte RDB version and the CRC64 (Jones, reflected) of all before it,
//! both little-endian.

use rand::RngExt;

/// A parsed DUMP payload of an idem record.
#[derive(Debug, Clone)]
pub struct Dump {
    /// Type byte, module id and string opcode, kept verbatim.
    pub head: Vec<u8>,
    /// The record's codec bytes.
    pub record: Vec<u8>,
    pub rdb_version: [u8; 2],
}

impl Dump {
    pub fn parse(p: &[u8]) -> Dump {
        assert!(p.len() > 10 + 12, "short DUMP payload");
        let (body, footer) = p.split_at(p.len() - 10);
        assert_eq!(
            crc64(&p[..p.len() - 8]).to_le_bytes(),
            footer[2..],
            "CRC64 of a real DUMP"
        );
        assert_eq!(body[0], 7, "module value (RDB_TYPE_MODULE_2)");
        assert_eq!(body[1], 0x81, "64-bit module id");
        assert_eq!(body[10], 5, "string opcode");
        let (len, used) = read_len(&body[11..]);
        let start = 11 + used;
        assert_eq!(
            body.len(),
            start + len + 1,
            "one uncompressed string, then EOF"
        );
        assert_eq!(body[body.len() - 1], 0, "EOF opcode");
        Dump {
            head: body[..11].to_vec(),
            record: body[start..start + len].to_vec(),
            rdb_version: [footer[0], footer[1]],
        }
    }

    /// The payload for `record` bytes, with a valid footer.
    pub fn build(&self, record: &[u8]) -> Vec<u8> {
        let mut p = self.head.clone();
        write_len(&mut p, record.len());
        p.extend_from_slice(record);
        p.push(0);
        p.extend_from_slice(&self.rdb_version);
        let crc = crc64(&p);
        p.extend_from_slice(&crc.to_le_bytes());
        p
    }
}

fn read_len(b: &[u8]) -> (usize, usize) {
    match b[0] >> 6 {
        0 => ((b[0] & 0x3f) as usize, 1),
        1 => ((((b[0] & 0x3f) as usize) << 8) | b[1] as usize, 2),
        _ if b[0] == 0x80 => (u32::from_be_bytes(b[1..5].try_into().unwrap()) as usize, 5),
        _ => panic!("compressed or special string encoding {:#x}", b[0]),
    }
}

fn write_len(out: &mut Vec<u8>, len: usize) {
    if len < 1 << 6 {
        out.push(len as u8);
    } else if len < 1 << 14 {
        out.extend_from_slice(&[0x40 | (len >> 8) as u8, len as u8]);
    } else {
        out.push(0x80);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

/// Redis' CRC64 (Jones polynomial, reflected, no final xor).
pub fn crc64(data: &[u8]) -> u64 {
    const POLY: u64 = 0x95ac_9329_ac4b_c9b5;
    data.iter().fold(0u64, |mut crc, &b| {
        crc ^= u64::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ POLY
            } else {
                crc >> 1
            };
        }
        crc
    })
}

// Offsets in the v1 record encoding (idem_core::codec).
const TOKEN: usize = 33;
const CREATED: usize = 41;
const EXPIRES: usize = 49;
const VARIANT: usize = 57;
/// lease_until (in progress) or status (completed).
const AFTER_VARIANT: usize = 61;
const BODY_LEN: usize = 63;

fn put_u64(r: &mut [u8], at: usize, v: u64) {
    if r.len() >= at + 8 {
        r[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

/// Values at and beyond every bound a record field has.
fn hostile_u64(rng: &mut impl RngExt) -> u64 {
    const V: [u64; 10] = [
        0,
        1,
        (1 << 53) - 1,
        1 << 53,
        (1 << 53) + 5,
        i64::MAX as u64,
        1 << 63,
        u64::MAX,
        u64::MAX - 1,
        4_102_444_800_000, // 2100-01-01 in ms
    ];
    if rng.random_bool(0.8) {
        V[rng.random_range(0..V.len())]
    } else {
        rng.random()
    }
}

/// One random mutation of a record's codec bytes. `fields`: also forge
/// field values (tokens, times, status, lengths, random bytes); otherwise
/// only the structure (format, variant, mirror state, cuts, trailing junk).
pub fn mutate(record: &[u8], rng: &mut impl RngExt, fields: bool) -> Vec<u8> {
    let mut r = record.to_vec();
    if r.len() < BODY_LEN + 8 {
        // Already cut short: grow it by junk.
        r.extend((0..rng.random_range(1..80)).map(|_| rng.random::<u8>()));
        return r;
    }
    let completed = r.get(VARIANT) == Some(&1);
    let kind = if fields {
        rng.random_range(0..12)
    } else {
        [4, 7, 8, 9, 10][rng.random_range(0..5)]
    };
    match kind {
        0 => {
            for _ in 0..rng.random_range(1..5) {
                let i = rng.random_range(0..r.len());
                r[i] = rng.random();
            }
        }
        1 => put_u64(&mut r, TOKEN, hostile_u64(rng)),
        2 => put_u64(
            &mut r,
            [CREATED, EXPIRES][rng.random_range(0..2)],
            hostile_u64(rng),
        ),
        3 if !completed => put_u64(&mut r, AFTER_VARIANT, hostile_u64(rng)),
        3 => {
            let at = r.len() - 12;
            put_u64(&mut r, at, hostile_u64(rng)); // completed_at
        }
        4 => {
            let v: u32 = [2, 3, u32::MAX, rng.random()][rng.random_range(0..4)];
            r[VARIANT..VARIANT + 4].copy_from_slice(&v.to_le_bytes());
        }
        5 if completed => {
            let s: u16 = [0, 99, 600, u16::MAX][rng.random_range(0..4)];
            r[AFTER_VARIANT..AFTER_VARIANT + 2].copy_from_slice(&s.to_le_bytes());
        }
        6 if completed => {
            let len = u64::from_le_bytes(r[BODY_LEN..BODY_LEN + 8].try_into().unwrap());
            let v = [u64::MAX, len + 1, len.saturating_sub(1), 1 << 40][rng.random_range(0..4)];
            put_u64(&mut r, BODY_LEN, v);
        }
        7 => r.truncate(rng.random_range(0..r.len())),
        8 => r.extend((0..rng.random_range(1..16)).map(|_| rng.random::<u8>())),
        9 => r[0] = [0, 2, 255][rng.random_range(0..3)],
        10 if completed => {
            let at = r.len() - 4;
            let v: u32 = [2, u32::MAX][rng.random_range(0..2)];
            r[at..].copy_from_slice(&v.to_le_bytes());
        }
        10 => r[VARIANT] = 7,
        _ => {
            let i = rng.random_range(0..r.len());
            r[i] ^= 1 << rng.random_range(0..8);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc64_matches_redis() {
        // Redis' crc64 test vector (src/crc64.c).
        assert_eq!(crc64(b"123456789"), 0xe9c6_d914_c4b8_d9ca);
    }

    #[test]
    fn lengths_round_trip() {
        for len in [0, 1, 63, 64, 16383, 16384, 1 << 20] {
            let mut b = Vec::new();
            write_len(&mut b, len);
            assert_eq!(read_len(&b), (len, b.len()));
        }
    }
}
