//! Fuzz target: a packed replay (`IDEM.BEGIN ... PACKED`) is read without
//! panicking, whatever is accepted packs back to exactly the input, and the
//! in-place view (`Packed`, the client's reader) accepts exactly that and
//! reads the same response.
#![no_main]

use idem_core::wire::{Begin, BeginReply, Frame, Packed, Recorder, ReplayLayout};
use idem_core::{Completed, MirrorState};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reply = Frame::Array(vec![
        Frame::Bulk(b"replay".to_vec()),
        Frame::Bulk(data.to_vec()),
    ]);
    let parsed = BeginReply::parse(&reply);
    let view = Packed::parse(data);
    assert_eq!(parsed.is_ok(), view.is_ok());
    if let (Ok(BeginReply::Replay(stored)), Ok(view)) = (&parsed, view) {
        assert_eq!(view.status, stored.status);
        assert_eq!(view.body, &stored.body[..]);
        let headers: Vec<(&[u8], &[u8])> = stored
            .headers
            .iter()
            .map(|h| (&h.name[..], &h.value[..]))
            .collect();
        assert_eq!(view.headers().collect::<Vec<_>>(), headers);
    }
    if let Ok(BeginReply::Replay(stored)) = parsed {
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
