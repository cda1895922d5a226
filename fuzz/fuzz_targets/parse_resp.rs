//! Fuzz target: the Pipe's RESP parser (`crates/idem-client/src/pipe/resp.rs`,
//! compiled from its file) never panics on any bytes; fed in the pieces the
//! first input byte chooses, it reads what it reads whole; and every value
//! it reads is the one redis-rs' parser reads from the same bytes (except
//! at the nesting limit, where it reads one level more: see
//! crates/idem-client/tests/pipe_vs_redis_rs.rs).
#![no_main]

#[allow(dead_code)]
#[path = "../../crates/idem-client/src/pipe/resp.rs"]
mod resp;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&step, data)) = input.split_first() else {
        return;
    };
    // Whole, reply after reply.
    let mut whole = Vec::new();
    let mut at = 0;
    let ending = loop {
        match resp::parse(&data[at..]) {
            Ok(Some((value, used))) => {
                assert!(used > 0 && at + used <= data.len());
                at += used;
                whole.push(value);
            }
            other => break other.map(|_| ()),
        }
    };
    // In pieces of `step` bytes (at least 1), as the connection reads them.
    let step = usize::from(step).max(1);
    let mut parser = resp::Parser::default();
    let (mut buf, mut pieces, mut refused) = (Vec::new(), Vec::new(), false);
    'feed: for chunk in data.chunks(step) {
        buf.extend_from_slice(chunk);
        let mut at = 0;
        loop {
            match parser.next(&buf, &mut at) {
                Ok(Some(value)) => pieces.push(value),
                Ok(None) => break,
                Err(_) => {
                    refused = true;
                    break 'feed;
                }
            }
        }
        buf.drain(..at);
    }
    assert_eq!(pieces, whole);
    assert_eq!(refused, ending.is_err());
    // Each value read is redis-rs' value of the same reply.
    let mut at = 0;
    for value in &whole {
        let (_, used) = resp::parse(&data[at..]).unwrap().unwrap();
        match redis::parse_redis_value(&data[at..at + used]) {
            Ok(theirs) => assert_eq!(&theirs, value),
            Err(e) => assert!(e.to_string().contains("recursion depth"), "{e}"),
        }
        at += used;
    }
});
