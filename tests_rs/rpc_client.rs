//! The client reads its replies itself (`rpc/client.rs`, leader/follower):
//! replies in any order reach their callers; a caller that stops waiting
//! hands the reading on to one still waiting; a reply split across writes,
//! or sharing a write with others, is put together; replies nobody waits
//! for are still read (the server never blocks on them); a hang-up while no
//! call is in flight is noticed; closing the client wakes a caller asleep
//! on its reply; an oversize reply ends the connection. Against a fake
//! server whose replies the test writes by hand.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::rpc::wire::{self, Reply, Request, Value};
use lmcache_rc_core::rpc::{Client, ClientConfig};

use crate::rpc_common::*;
use crate::service_common::HANG_GUARD;

/// A fake server: one connection, welcomed; every request goes to the test
/// (id and request), which writes the replies through `conn`.
struct Fake {
    conn: UnixStream,
    requests: Receiver<(u64, Request)>,
    _dir: tempfile::TempDir,
    client: Client,
}

impl Fake {
    fn start(config: ClientConfig) -> Fake {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fake.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let (tx, requests) = channel();
        let (conn_tx, conn_rx) = channel();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            read_payload(&mut s).unwrap();
            send_welcome(&s);
            conn_tx.send(s.try_clone().unwrap()).unwrap();
            while let Some(payload) = read_payload(&mut s) {
                let (id, body) = wire::split_id(&payload).unwrap();
                if tx.send((id, wire::decode_request(body).unwrap())).is_err() {
                    break;
                }
            }
        });
        let client = Client::connect_with(&socket, config).unwrap();
        let conn = conn_rx.recv_timeout(HANG_GUARD).unwrap();
        Fake {
            conn,
            requests,
            _dir: dir,
            client,
        }
    }

    /// The next `n` requests, by the generation their `abort` names.
    fn aborts(&self, n: usize) -> Vec<(u64, String)> {
        (0..n)
            .map(|_| match self.requests.recv_timeout(HANG_GUARD).unwrap() {
                (id, Request::Abort { generation }) => (id, generation),
                (_, other) => panic!("unexpected request {other:?}"),
            })
            .collect()
    }

    fn reply_frame(id: u64, reply: &Reply) -> Vec<u8> {
        wire::encode_reply(id, reply, wire::DEFAULT_MAX_FRAME).unwrap()
    }

    fn reply(&self, id: u64, reply: &Reply) {
        (&self.conn)
            .write_all(&Self::reply_frame(id, reply))
            .unwrap();
    }
}

fn count(n: u64) -> Reply {
    Reply::Ok(Value::Count(n))
}

fn abort(g: &str) -> Request {
    Request::Abort {
        generation: g.to_string(),
    }
}

#[test]
fn replies_in_any_order_reach_their_callers() {
    let fake = Fake::start(ClientConfig::default());
    std::thread::scope(|s| {
        let callers: Vec<_> = (0..4u64)
            .map(|i| {
                let client = &fake.client;
                s.spawn(move || client.call(abort(&format!("g{i}"))).unwrap())
            })
            .collect();
        let mut got = fake.aborts(4);
        // Answer in reverse order of arrival: each reply names its request.
        got.reverse();
        for (id, generation) in got {
            let n: u64 = generation[1..].parse().unwrap();
            fake.reply(id, &count(n));
        }
        for (i, caller) in callers.into_iter().enumerate() {
            assert_eq!(caller.join().unwrap(), Value::Count(i as u64));
        }
    });
}

#[test]
fn a_caller_that_stops_waiting_hands_the_reading_on() {
    let fake = Fake::start(ClientConfig::default());
    std::thread::scope(|s| {
        let client = &fake.client;
        // The first caller reads (nobody else is waiting) until it gives up.
        let impatient =
            s.spawn(move || client.call_with_timeout(abort("a"), Duration::from_millis(300)));
        let a = fake.aborts(1);
        std::thread::sleep(Duration::from_millis(50));
        // The second waits behind it, asleep.
        let patient = s.spawn(move || client.call_with_timeout(abort("b"), HANG_GUARD));
        let b = fake.aborts(1);
        let e = impatient.join().unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        // Only now does the reply to the waiting caller arrive: it must be
        // read by that caller (or someone it handed the reading to).
        std::thread::sleep(Duration::from_millis(50));
        fake.reply(b[0].0, &count(2));
        assert_eq!(patient.join().unwrap().unwrap(), Value::Count(2));
        // The abandoned call's late reply is dropped; the client goes on.
        fake.reply(a[0].0, &count(1));
    });
    let t = Instant::now();
    let pending = fake.client.call_async(abort("c"));
    let c = fake.aborts(1);
    fake.reply(c[0].0, &count(3));
    assert_eq!(pending.wait(Some(HANG_GUARD)).unwrap(), Value::Count(3));
    assert!(t.elapsed() < HANG_GUARD);
}

#[test]
fn a_reply_in_pieces_and_replies_sharing_a_write_are_put_together() {
    let fake = Fake::start(ClientConfig::default());
    let first = fake.client.call_async(abort("x"));
    let x = fake.aborts(1);
    let waiter = std::thread::spawn({
        let frame = Fake::reply_frame(x[0].0, &count(7));
        let conn = fake.conn.try_clone().unwrap();
        move || {
            for byte in frame {
                (&conn).write_all(&[byte]).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    });
    assert_eq!(first.wait(Some(HANG_GUARD)).unwrap(), Value::Count(7));
    waiter.join().unwrap();
    // Three replies in one write, the last one cut short, then its rest.
    let pending: Vec<_> = (0..3)
        .map(|i| fake.client.call_async(abort(&format!("y{i}"))))
        .collect();
    let ids = fake.aborts(3);
    let mut bytes = Vec::new();
    for (id, generation) in &ids {
        let n: u64 = generation[1..].parse().unwrap();
        bytes.extend(Fake::reply_frame(*id, &count(100 + n)));
    }
    let cut = bytes.len() - 3;
    (&fake.conn).write_all(&bytes[..cut]).unwrap();
    assert_eq!(
        pending[0].wait(Some(HANG_GUARD)).unwrap(),
        Value::Count(100)
    );
    assert_eq!(
        pending[1].wait(Some(HANG_GUARD)).unwrap(),
        Value::Count(101)
    );
    let e = pending[2]
        .wait(Some(Duration::from_millis(100)))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "the last reply is incomplete");
    (&fake.conn).write_all(&bytes[cut..]).unwrap();
    assert_eq!(
        pending[2].wait(Some(HANG_GUARD)).unwrap(),
        Value::Count(102)
    );
}

#[test]
fn replies_nobody_waits_for_are_still_read() {
    let fake = Fake::start(ClientConfig::default());
    // 64 calls whose futures nobody looks at; their replies (256 KiB each,
    // 16 MiB in all) are far more than a socket buffer holds, so the fake
    // server's writes finish only if the client reads them.
    let pending: Vec<_> = (0..64)
        .map(|i| fake.client.call_async(abort(&format!("z{i}"))))
        .collect();
    let ids = fake.aborts(64);
    let big = Reply::error(ErrorKind::Internal, "x".repeat(256 << 10));
    let conn = fake.conn.try_clone().unwrap();
    let (done_tx, done_rx) = channel();
    std::thread::spawn(move || {
        for (id, _) in ids {
            (&conn).write_all(&Fake::reply_frame(id, &big)).unwrap();
        }
        done_tx.send(()).unwrap();
    });
    done_rx
        .recv_timeout(HANG_GUARD)
        .expect("the client's watcher read the replies nobody waited for");
    for p in &pending {
        let e = p.wait(Some(HANG_GUARD)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Internal);
    }
}

#[test]
fn a_hang_up_while_no_call_is_in_flight_is_noticed() {
    let fake = Fake::start(ClientConfig::default());
    let pending = fake.client.call_async(abort("h"));
    let h = fake.aborts(1);
    fake.reply(h[0].0, &count(1));
    assert_eq!(pending.wait(Some(HANG_GUARD)).unwrap(), Value::Count(1));
    assert!(fake.client.is_connected());
    fake.conn.shutdown(std::net::Shutdown::Both).unwrap();
    let deadline = Instant::now() + HANG_GUARD;
    while fake.client.is_connected() {
        assert!(Instant::now() < deadline, "the hang-up was never noticed");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn closing_the_client_wakes_a_caller_asleep_on_its_reply() {
    let fake = Fake::start(ClientConfig::default());
    std::thread::scope(|s| {
        let client = &fake.client;
        let reading = s.spawn(move || client.call_async(abort("r1")).wait(None));
        let asleep = s.spawn(move || client.call_async(abort("r2")).wait(None));
        fake.aborts(2);
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        client.close();
        for caller in [reading, asleep] {
            let e = caller.join().unwrap().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
        }
        assert!(t.elapsed() < Duration::from_secs(5));
    });
}

#[test]
fn an_oversize_reply_ends_the_connection() {
    let fake = Fake::start(ClientConfig {
        max_frame: 1024,
        ..ClientConfig::default()
    });
    let pending = fake.client.call_async(abort("o"));
    let o = fake.aborts(1);
    fake.reply(o[0].0, &Reply::error(ErrorKind::Internal, "y".repeat(4096)));
    let e = pending.wait(Some(HANG_GUARD)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("oversize"), "{e}");
    assert!(!fake.client.is_connected());
}
