//! The wire format on its own: every message survives encode → decode,
//! frames are bounded and truncation is detected, the handshake negotiates
//! versions, and undecodable bytes are typed protocol errors, never panics.

use std::io::Cursor;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::protocol::{
    Capabilities, ClearReport, GenerationInfo, Lease, LeaseStatus, MissReason, ServiceStatus,
};
use lmcache_rc_core::rpc::wire::{
    self, FrameError, Reply, Request, Value, WireError, WireManifest, WirePrefix,
};
use proptest::prelude::*;

fn prefix() -> impl Strategy<Value = WirePrefix> {
    (
        "[a-z0-9:-]{0,40}",
        any::<u64>(),
        prop_oneof![Just(Vec::new()), proptest::collection::vec(any::<u8>(), 32)],
        proptest::collection::vec(any::<u32>(), 0..20),
    )
        .prop_map(
            |(namespace, start_tokens, prefix_hash, tail_tokens)| WirePrefix {
                namespace,
                start_tokens,
                prefix_hash,
                tail_tokens,
            },
        )
}

fn manifest() -> impl Strategy<Value = WireManifest> {
    (
        "\\PC{0,20}",
        prefix(),
        any::<u32>(),
        proptest::collection::vec(any::<u8>(), 0..200),
    )
        .prop_map(|(generation, prefix, world_size, payload)| WireManifest {
            generation,
            prefix,
            world_size,
            payload,
        })
}

fn lease_id() -> impl Strategy<Value = String> {
    "\\PC{0,24}"
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        Just(Request::Capabilities {}),
        proptest::collection::vec(prefix(), 0..4).prop_map(|roots| Request::Find { roots }),
        manifest().prop_map(|manifest| Request::Begin { manifest }),
        "\\PC{0,40}".prop_map(|generation| Request::Abort { generation }),
        (manifest(), any::<u32>())
            .prop_map(|(manifest, rank)| Request::PrepareStore { manifest, rank }),
        (lease_id(), any::<bool>(), any::<Option<u32>>()).prop_map(|(lease_id, success, rank)| {
            Request::FinishStore {
                lease_id,
                success,
                rank,
            }
        }),
        (manifest(), any::<u32>())
            .prop_map(|(manifest, rank)| Request::BeginRetrieve { manifest, rank }),
        (lease_id(), any::<Option<u32>>())
            .prop_map(|(lease_id, rank)| Request::PollRetrieve { lease_id, rank }),
        (lease_id(), any::<Option<u32>>())
            .prop_map(|(lease_id, rank)| Request::FinishRetrieve { lease_id, rank }),
        (lease_id(), any::<Option<u32>>())
            .prop_map(|(lease_id, rank)| Request::CancelRetrieve { lease_id, rank }),
        Just(Request::Status {}),
        (any::<bool>(), any::<bool>())
            .prop_map(|(force, all_tiers)| Request::Clear { force, all_tiers }),
        Just(Request::ListGenerations {}),
        "\\PC{0,40}".prop_map(|namespace| Request::InvalidateNamespace { namespace }),
    ]
}

fn lease() -> impl Strategy<Value = Lease> {
    (
        prop_oneof![
            Just(LeaseStatus::Ready),
            Just(LeaseStatus::Busy),
            Just(LeaseStatus::Miss),
            Just(LeaseStatus::Pending),
        ],
        proptest::option::of(lease_id()),
        proptest::collection::vec(
            proptest::collection::vec(any::<Option<(u64, u64)>>(), 0..5),
            0..4,
        ),
        proptest::option::of(proptest::sample::select(MissReason::ALL)),
        proptest::option::of("[0-9a-f]{32}"),
    )
        .prop_map(|(status, lease_id, slots, reason, pool_id)| Lease {
            status,
            lease_id,
            slots,
            reason,
            pool_id,
        })
}

fn counters() -> impl Strategy<Value = std::collections::BTreeMap<String, u64>> {
    proptest::collection::btree_map("[a-z_]{1,20}", any::<u64>(), 0..8)
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Unit),
        any::<bool>().prop_map(Value::Bool),
        (
            any::<u32>(),
            any::<u32>(),
            "\\PC{0,30}",
            any::<u64>(),
            any::<bool>()
        )
            .prop_map(|(f, p, pool_id, pool_size, durable_index)| {
                Value::Capabilities(Capabilities {
                    format_version: f,
                    protocol_version: p,
                    pool_id,
                    pool_size,
                    durable_index,
                })
            }),
        proptest::option::of(manifest()).prop_map(Value::Manifest),
        lease().prop_map(Value::Lease),
        (
            counters(),
            counters(),
            proptest::collection::btree_map(
                "[a-z_]{1,12}",
                proptest::option::of("[ -~]{0,24}"),
                0..4
            )
        )
            .prop_map(|(values, misses, info)| Value::Status(ServiceStatus {
                values,
                misses,
                info
            })),
        any::<[u64; 5]>().prop_map(|[a, b, c, d, e]| Value::Clear(ClearReport {
            l1_objects: a,
            l1_bytes: b,
            l2_objects: c,
            retired_generations: d,
            kept_objects: e,
        })),
        proptest::collection::vec(
            (
                "\\PC{0,40}",
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                any::<bool>(),
                any::<i64>()
            )
                .prop_map(
                    |(generation, num_tokens, world_size, payload_bytes, durable, access_order)| {
                        GenerationInfo {
                            generation,
                            num_tokens,
                            world_size,
                            payload_bytes,
                            durable,
                            access_order,
                        }
                    }
                ),
            0..4,
        )
        .prop_map(Value::Generations),
        any::<u64>().prop_map(Value::Count),
    ]
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        value().prop_map(Reply::Ok),
        ("[A-Za-z]{1,20}", "\\PC{0,60}")
            .prop_map(|(kind, message)| Reply::Err(WireError { kind, message })),
    ]
}

/// Reads one frame back from encoded bytes and checks nothing is left over.
fn unframe(bytes: &[u8]) -> Vec<u8> {
    let mut cursor = Cursor::new(bytes);
    let mut buf = Vec::new();
    wire::read_frame(&mut cursor, wire::DEFAULT_MAX_FRAME, &mut buf).unwrap();
    assert_eq!(cursor.position() as usize, bytes.len(), "one frame exactly");
    buf
}

proptest! {
    #[test]
    fn every_request_decodes_to_itself(id in 1u64.., req in request()) {
        let bytes = wire::encode_request(id, &req, wire::DEFAULT_MAX_FRAME).unwrap();
        let payload = unframe(&bytes);
        let (got_id, body) = wire::split_id(&payload).unwrap();
        prop_assert_eq!(got_id, id);
        prop_assert_eq!(wire::decode_request(body).unwrap(), req);
    }

    #[test]
    fn every_reply_decodes_to_itself(id in any::<u64>(), rep in reply()) {
        let bytes = wire::encode_reply(id, &rep, wire::DEFAULT_MAX_FRAME).unwrap();
        let payload = unframe(&bytes);
        let (got_id, body) = wire::split_id(&payload).unwrap();
        prop_assert_eq!(got_id, id);
        prop_assert_eq!(wire::decode_reply(body).unwrap(), rep);
    }

    #[test]
    fn every_truncation_of_a_frame_is_detected(req in request(), cut in any::<prop::sample::Index>()) {
        let bytes = wire::encode_request(7, &req, wire::DEFAULT_MAX_FRAME).unwrap();
        let cut = 1 + cut.index(bytes.len() - 1);
        let mut buf = Vec::new();
        let got = wire::read_frame(&mut Cursor::new(&bytes[..cut]), wire::DEFAULT_MAX_FRAME, &mut buf);
        prop_assert!(matches!(got, Err(FrameError::Truncated { .. })), "{:?}", got);
    }

    #[test]
    fn every_truncated_message_is_a_protocol_error(req in request(), cut in any::<prop::sample::Index>()) {
        let bytes = wire::encode_request(7, &req, wire::DEFAULT_MAX_FRAME).unwrap();
        let body = &bytes[4 + 8..];
        let cut = cut.index(body.len());
        // A prefix of a message either fails to decode (a typed error) or,
        // when the prefix happens to be a complete shorter message, decodes:
        // never a panic.
        if let Err(e) = wire::decode_request(&body[..cut]) {
            prop_assert_eq!(e.kind(), ErrorKind::Protocol);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Err(e) = wire::decode_request(&bytes) {
            prop_assert_eq!(e.kind(), ErrorKind::Protocol);
        }
        if let Err(e) = wire::decode_reply(&bytes) {
            prop_assert_eq!(e.kind(), ErrorKind::Protocol);
        }
        let _ = wire::decode_hello(&bytes);
        let _ = wire::decode_welcome(&bytes);
    }
}

#[test]
fn oversize_frames_are_refused_before_their_body_is_read() {
    let mut bytes = 1001u32.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[0u8; 8]);
    let mut cursor = Cursor::new(&bytes);
    let mut buf = Vec::new();
    match wire::read_frame(&mut cursor, 1000, &mut buf) {
        Err(FrameError::Oversize {
            len: 1001,
            max: 1000,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(cursor.position(), 4, "only the length prefix was read");
    // Exactly at the limit is fine.
    let ok = wire::encode_reply(1, &Reply::Ok(Value::Unit), 1000).unwrap();
    wire::read_frame(&mut Cursor::new(&ok), ok.len() - 4, &mut buf).unwrap();
}

#[test]
fn encoding_beyond_the_frame_limit_is_a_protocol_error() {
    let req = Request::Abort {
        generation: "g".repeat(2000),
    };
    let e = wire::encode_request(1, &req, 1000).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol);
    assert!(e.to_string().contains("1000-byte frame limit"), "{e}");
}

#[test]
fn an_empty_stream_is_eof_not_truncation() {
    let mut buf = Vec::new();
    assert!(matches!(
        wire::read_frame(&mut Cursor::new(&[] as &[u8]), 10, &mut buf),
        Err(FrameError::Eof)
    ));
}

#[test]
fn unknown_request_types_and_trailing_bytes_are_protocol_errors() {
    for body in [&[14u8][..], &[200, 1], &[0, 0], &[], &[3, 5, b'a']] {
        let e = wire::decode_request(body).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{body:?}: {e}");
    }
    // A generation that is not UTF-8.
    let e = wire::decode_request(&[3, 2, 0xff, 0xfe]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol);
    assert!(wire::split_id(&[1, 2, 3]).is_err());
}

#[test]
fn request_type_numbers_are_pinned() {
    // The variant index is the request type on the wire: append only.
    let expected: [(Request, u8); 14] = [
        (Request::Capabilities {}, 0),
        (Request::Find { roots: vec![] }, 1),
        (
            Request::Abort {
                generation: String::new(),
            },
            3,
        ),
        (
            Request::FinishStore {
                lease_id: String::new(),
                success: true,
                rank: None,
            },
            5,
        ),
        (
            Request::PollRetrieve {
                lease_id: String::new(),
                rank: None,
            },
            7,
        ),
        (
            Request::FinishRetrieve {
                lease_id: String::new(),
                rank: None,
            },
            8,
        ),
        (
            Request::CancelRetrieve {
                lease_id: String::new(),
                rank: None,
            },
            9,
        ),
        (Request::Status {}, 10),
        (
            Request::Clear {
                force: true,
                all_tiers: false,
            },
            11,
        ),
        (Request::ListGenerations {}, 12),
        (
            Request::InvalidateNamespace {
                namespace: String::new(),
            },
            13,
        ),
        (Request::Capabilities {}, 0),
        (Request::Status {}, 10),
        (Request::Find { roots: vec![] }, 1),
    ];
    for (req, tag) in expected {
        let bytes = wire::encode_request(1, &req, 1 << 20).unwrap();
        assert_eq!(bytes[4 + 8], tag, "{req:?}");
    }
    let ok = wire::encode_reply(1, &Reply::Ok(Value::Bool(true)), 100).unwrap();
    assert_eq!(&ok[4 + 8..], &[0, 1, 1], "Ok(Bool(true))");
}

#[test]
fn handshake_negotiates_the_highest_common_version() {
    let hello = wire::encode_hello(1, 9);
    assert_eq!(&hello[4..8], b"LMRC");
    assert_eq!(wire::decode_hello(&hello[4..]).unwrap(), (1, 9));
    assert_eq!(wire::negotiate(1, 9), Ok(wire::PROTOCOL_VERSION));
    assert_eq!(
        wire::negotiate(wire::PROTOCOL_VERSION, wire::PROTOCOL_VERSION),
        Ok(wire::PROTOCOL_VERSION)
    );
    let refused = wire::negotiate(wire::PROTOCOL_VERSION + 1, 99).unwrap_err();
    assert!(
        refused.contains("unsupported protocol version"),
        "{refused}"
    );
    assert!(wire::negotiate(5, 1).is_err(), "an empty range");
    let welcome = wire::encode_welcome(0, "no");
    assert_eq!(
        wire::decode_welcome(&welcome[4..]).unwrap(),
        (0, "no".into())
    );
    assert!(wire::decode_hello(b"HTTP/1.1 GET").is_err());
    assert!(wire::decode_welcome(b"LMR").is_err());
}

#[test]
fn error_replies_keep_their_kind_across_the_wire() {
    for &kind in ErrorKind::ALL {
        let e: lmcache_rc_core::Error = WireError {
            kind: kind.as_str().into(),
            message: "m".into(),
        }
        .into();
        assert_eq!(e.kind(), kind);
        assert_eq!(e.to_string(), "m");
    }
    let unknown: lmcache_rc_core::Error = WireError {
        kind: "FromTheFuture".into(),
        message: "m".into(),
    }
    .into();
    assert_eq!(unknown.kind(), ErrorKind::Protocol);
    assert!(unknown.to_string().contains("FromTheFuture"));
}
