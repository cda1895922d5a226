//! Fuzz target: a packed replay (`IDEM.BEGIN ... PACKED`) is read without
//! panicking, and whatever is accepted packs back to exactly the input.
#![no_main]

use idem_core::wire::{Begin, BeginReply, Frame, Recorder, ReplayLayout};
use idem_core::{Completed, MirrorState};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reply = Frame::Array(vec![
        Frame::Bulk(b"replay".to_vec()),
        Frame::Bulk(data.to_vec()),
    ]);
    if let Ok(BeginReply::Replay(stored)) = BeginReply::parse(&reply) {
        let completed = Completed {
            status: stored.status,
            body: stored.body,
            headers: stored.headers,
            completed_at: 1,
            mirror: MirrorState::Pending,
        };
        let mut again = Recorder::default();
        Begin::Replay(&completed).write(&mut again, ReplayLayout::Packed);
        assert_eq!(again.into_frames(), vec![reply]);
    }
});
