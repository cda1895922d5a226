//! `IDEM.MIRROR.PULL count [CLAIM ms] [BLOCK ms]` and `IDEM.MIRROR.ACK key
//! token`, and the pullers blocked waiting for records.

use idem_core::wire::{self, ReplySink};
use idem_core::{args, engine, Error, Record};

use super::{forget, with_index};
use crate::ffi::acl::{self, Caller};
use crate::ffi::blocked::{BlockedClient, Blocking, Timer};
use crate::ffi::call::{guard, Call};
use crate::ffi::ctx::{now_ms, Ctx, OwnedString};
use crate::ffi::key::Key;
use crate::{config, stats, Shared};

/// A client blocked in `IDEM.MIRROR.PULL ... BLOCK`.
struct Puller {
    id: u64,
    bc: BlockedClient<Pulling>,
    db: i32,
    /// Its ACL user (None: trusted), asked again when a record arrives.
    user: Option<Vec<u8>>,
}

struct Pullers {
    list: Vec<Puller>,
    next_id: u64,
}

/// Blocked pullers. Each leaves this list exactly once, and whoever takes it
/// out unblocks it: a wake-up, its deadline timer, or its disconnect.
static PULLERS: Shared<Pullers> = Shared::new(Pullers {
    list: Vec::new(),
    next_id: 1,
});

/// `IDEM.MIRROR.PULL count [CLAIM ms] [BLOCK ms]`
pub fn pull(call: &Call) -> Result<(), Error> {
    let req = args::pull_within(
        &call.args,
        config::mirror_claim_ms(),
        config::mirror_max_claim_ms(),
    )?;
    let db = call.ctx.db();
    let caller = Caller::of(call.ctx);
    let batch = claim(call.ctx, db, &req, &caller);
    match req.block_ms {
        Some(ms) if ms > 0 && batch.is_empty() && call.ctx.may_block() => {
            // Only a claim this caller could take shortens the wait.
            let next = with_index(db, |i| i.next_available_where(|k| caller.may_read(k))).flatten();
            let timeout = next.map_or(ms, |at| ms.min(at.saturating_sub(now_ms()).max(1)));
            block_puller(call.ctx, db, timeout);
        }
        _ => reply_batch(call.ctx, batch),
    }
    Ok(())
}

/// A claimed record's key, held open until the reply is written, so the
/// reply borrows the record from Redis instead of copying it.
struct Claimed {
    key: Key,
    _name: OwnedString,
    name: Vec<u8>,
}

/// Claims up to `count` records the caller may read; drops index entries
/// whose record is gone, replaced or already mirrored.
fn claim(ctx: Ctx, db: i32, req: &args::Pull, caller: &Caller) -> Vec<Claimed> {
    let now = now_ms();
    let mut out = Vec::new();
    loop {
        let want = req.count - out.len();
        // Only records the caller may read are handed out or claimed: a user
        // limited to `~pay:*` neither sees nor hides anyone else's.
        let claimed = with_index(db, |i| {
            i.claim_where(now, want, req.claim_ms, |k| caller.may_read(k))
        })
        .unwrap_or_default();
        if claimed.is_empty() {
            return out;
        }
        for (name, token) in claimed {
            let key_name = ctx.string(&name);
            let mut key = Key::inspect(ctx, key_name.name());
            let pending =
                matches!(key.record(), Ok(Some(r)) if r.token == token && r.mirror_pending());
            if pending {
                out.push(Claimed {
                    key,
                    _name: key_name,
                    name,
                });
            } else {
                drop(key);
                forget(db, &name);
            }
        }
        if out.len() == req.count {
            return out;
        }
    }
}

fn reply_batch(ctx: Ctx, mut batch: Vec<Claimed>) {
    // Nothing runs between the claim and this reply: every claimed key
    // still holds its pending record.
    let records: Vec<(&[u8], &Record)> = batch
        .iter_mut()
        .filter_map(|Claimed { key, name, .. }| {
            let record: &Record = key.record().ok().flatten()?;
            Some((&name[..], record))
        })
        .collect();
    wire::write_pull_batch(&mut ctx.reply(), records.iter().copied());
}

fn block_puller(ctx: Ctx, db: i32, timeout_ms: u64) {
    let user = acl::user_name(ctx);
    let bc = BlockedClient::block(ctx);
    let mut pullers = PULLERS.lock();
    let id = pullers.next_id;
    pullers.next_id += 1;
    // Not stopped when the puller is woken earlier: it then finds nobody.
    Timer::start(ctx, timeout_ms, id, puller_deadline);
    pullers.list.push(Puller { id, bc, db, user });
}

/// Answers the pullers that could receive `key`, now pending in `db`: each
/// claims what is there when it runs. The others (another database, or an
/// ACL user that may not read the key) sleep on.
pub fn wake_pullers(db: i32, key: &[u8]) {
    let may_receive = |p: &Puller| {
        p.db == db
            && p.user
                .as_deref()
                .is_none_or(|user| Caller::named(Ctx::detached(), user).may_read(key))
    };
    let woken = {
        let mut pullers = PULLERS.lock();
        let (woken, asleep) = std::mem::take(&mut pullers.list)
            .into_iter()
            .partition(may_receive);
        pullers.list = asleep;
        woken
    };
    for p in woken {
        p.bc.unblock(Some(p.db));
    }
}

/// Takes a blocked puller out of the list; None when it already left (and
/// so was already unblocked: unblocking twice would free it twice).
fn take_puller(pick: impl Fn(&Puller) -> bool) -> Option<Puller> {
    let mut pullers = PULLERS.lock();
    let pos = pullers.list.iter().position(pick)?;
    Some(pullers.list.swap_remove(pos))
}

/// The blocked `IDEM.MIRROR.PULL ... BLOCK` clients, answered with their
/// database.
struct Pulling;

impl Blocking for Pulling {
    type Answer = i32;
    const WHAT: &'static str = "pull reply";

    fn reply(ctx: Ctx, args: &[&[u8]], &db: &i32) {
        // Re-parse the blocked command's arguments and answer with a claim.
        let req = args::pull_within(
            args,
            config::mirror_claim_ms(),
            config::mirror_max_claim_ms(),
        );
        let batch = match req {
            Ok(req) => {
                ctx.select_db(db);
                claim(ctx, db, &req, &Caller::of(ctx))
            }
            Err(_) => Vec::new(),
        };
        reply_batch(ctx, batch);
    }

    fn disconnected(_ctx: Ctx, bc: BlockedClient<Pulling>) {
        if let Some(p) = take_puller(|p| p.bc == bc) {
            p.bc.unblock(None);
        }
    }
}

/// The puller's `BLOCK` ran out: it answers with whatever it can claim now
/// (usually nothing).
fn puller_deadline(_ctx: Ctx, id: u64) {
    guard("pull deadline", (), || {
        if let Some(p) = take_puller(|p| p.id == id) {
            p.bc.unblock(Some(p.db));
        }
    })
}

/// `IDEM.MIRROR.ACK key token`
pub fn ack(call: &Call) -> Result<(), Error> {
    let req = args::key_token(&call.args, "IDEM.MIRROR.ACK key token")?;
    let mut key = Key::open(call.ctx, call.key());
    let (matched, changed) = engine::ack(key.record()?, req.token);
    if changed {
        key.modified();
        forget(call.ctx.db(), req.key);
        stats::MIRROR_ACKS.incr();
        call.ctx.replicate_verbatim();
    }
    call.ctx.reply().int(matched.into());
    Ok(())
}
