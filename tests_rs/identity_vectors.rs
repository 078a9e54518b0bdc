//! Golden vectors (`vectors/identity-v1.json`, described in
//! `docs/design/identity.md#golden-vectors`): every hash must match
//! byte-for-byte and every rejected input must be refused with the typed error.

use lmcache_rc_core::json::Value;
use lmcache_rc_core::{Error, Prefix, TokenRoots, checkpoint_generation, checkpoint_namespace};
use serde_json::Value as J;
use sha2::{Digest, Sha256};

use crate::common::vectors;

fn identity_of(v: &J) -> Result<Value, Error> {
    Value::from_serde(v)
}

fn tokens_of(case: &J) -> Vec<u32> {
    if let Some(list) = case.get("tokens").and_then(J::as_array) {
        return list.iter().map(|t| t.as_u64().unwrap() as u32).collect();
    }
    let n = case["num_tokens"].as_u64().unwrap();
    match case["token_rule"].as_str().unwrap() {
        "range" => (0..n as u32).collect(),
        "mix31" => (0..n)
            .map(|i| ((i * 2654435761 + 12345) % (1u64 << 31)) as u32)
            .collect(),
        other => panic!("unknown token rule {other}"),
    }
}

fn check_prefix_object(p: &Prefix, want: &J, tokens_of_case: &str) {
    assert_eq!(
        p.namespace(),
        want["namespace"].as_str().unwrap(),
        "{tokens_of_case}"
    );
    assert_eq!(p.start_tokens(), want["start_tokens"].as_u64().unwrap());
    assert_eq!(
        hex::encode(p.prefix_hash()),
        want["prefix_hash_hex"].as_str().unwrap()
    );
    assert_eq!(p.num_tokens(), want["num_tokens"].as_u64().unwrap());
    assert_eq!(
        p.tail_tokens().len() as u64,
        want["tail_len"].as_u64().unwrap()
    );
    if let Some(tail) = want.get("tail_tokens") {
        let tail: Vec<u32> = tail
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(p.tail_tokens(), &tail[..]);
    } else {
        let tail = p.tail_tokens();
        assert_eq!(u64::from(tail[0]), want["tail_first"].as_u64().unwrap());
        assert_eq!(
            u64::from(*tail.last().unwrap()),
            want["tail_last"].as_u64().unwrap()
        );
        let bytes: Vec<u8> = tail.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            hex::encode(Sha256::digest(&bytes)),
            want["tail_u32le_sha256"].as_str().unwrap()
        );
    }
}

#[test]
fn namespaces_match_vectors_except_the_float_deviation() {
    let v = vectors();
    let deviations = v["lmcache_rc_deviations"].as_object().unwrap();
    let mut checked = 0;
    for case in v["namespaces"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let identity = identity_of(&case["identity"]);
        let salt = identity_of(&case["cache_salt"]).unwrap();
        if deviations.contains_key(name) {
            assert!(
                matches!(identity, Err(Error::InvalidInput(_))),
                "{name} must be refused"
            );
            continue;
        }
        let identity = identity.unwrap();
        let canonical = {
            let mut doc = std::collections::BTreeMap::new();
            doc.insert("cache_salt".to_string(), salt.clone());
            doc.insert("identity".to_string(), identity.clone());
            doc.insert("schema_version".to_string(), Value::Int(1));
            Value::Object(doc).to_canonical_ascii()
        };
        assert_eq!(
            canonical,
            case["canonical_json"].as_str().unwrap(),
            "{name}"
        );
        let ns = checkpoint_namespace(&identity, &salt).unwrap();
        assert_eq!(ns, case["namespace"].as_str().unwrap(), "{name}");
        checked += 1;
    }
    assert_eq!(checked, 8);
}

#[test]
fn falsy_draft_revision_is_accepted_and_hashed_as_given() {
    let v = vectors();
    let mut base = v["namespaces"][0]["identity"].clone();
    let salt = Value::Str("tenant-a".into());
    for (case, draft) in v["namespace_accepts"]
        .as_array()
        .unwrap()
        .iter()
        .zip([J::from(""), J::Null])
    {
        base["draft_revision"] = draft;
        let ns = checkpoint_namespace(&identity_of(&base).unwrap(), &salt).unwrap();
        assert_eq!(ns, case["namespace"].as_str().unwrap());
    }
}

#[test]
fn missing_or_empty_required_identity_fields_are_refused() {
    let v = vectors();
    let base = v["namespaces"][0]["identity"].clone();
    let salt = Value::Str(String::new());
    for key in [
        "target_revision",
        "draft_revision",
        "source_revision",
        "layout",
        "parallel",
    ] {
        let mut id = base.clone();
        id.as_object_mut().unwrap().remove(key);
        let err = checkpoint_namespace(&identity_of(&id).unwrap(), &salt).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
        assert!(err.to_string().contains("immutable"), "{err}");
    }
    for (key, empty) in [
        ("target_revision", J::from("")),
        ("source_revision", J::from("")),
        ("layout", serde_json::json!({})),
        ("parallel", J::from(0)),
        ("target_revision", J::Null),
        ("parallel", serde_json::json!([])),
        ("layout", J::from(false)),
    ] {
        let mut id = base.clone();
        id[key] = empty;
        let err = checkpoint_namespace(&identity_of(&id).unwrap(), &salt).unwrap_err();
        assert!(err.to_string().contains("immutable"), "{key}: {err}");
    }
    // The vectors' own error list is covered case by case in Python (it holds
    // Python reprs such as sets and NaN); here: a non-object identity is a type error.
    assert!(matches!(
        checkpoint_namespace(&Value::List(vec![]), &salt),
        Err(Error::InvalidType(_))
    ));
}

#[test]
fn token_cases_match_vectors() {
    let v = vectors();
    let cases = v["token_cases"].as_array().unwrap();
    assert_eq!(cases.len(), 15);
    for case in cases {
        let name = case["case"].as_str().unwrap();
        let tokens = tokens_of(case);
        assert_eq!(tokens.len() as u64, case["num_tokens"].as_u64().unwrap());
        let ns = case["namespace"].as_str().unwrap();
        let chunk = case["chunk_tokens"].as_u64().unwrap() as u32;
        let roots = TokenRoots::build(ns, tokens.clone(), chunk).unwrap();
        assert_eq!(
            hex::encode(roots.initial_chain()),
            case["initial_chain_hex"].as_str().unwrap(),
            "{name}"
        );

        let want_roots = case["roots"].as_array().unwrap();
        assert_eq!(roots.num_roots(), want_roots.len(), "{name}");
        let total: usize = roots.roots().iter().map(|r| r.tail_tokens().len()).sum();
        assert_eq!(total, tokens.len(), "{name}: tails partition the sequence");
        for (k, want) in want_roots.iter().enumerate() {
            check_prefix_object(&roots.root(k).unwrap(), want, name);
            assert_eq!(
                hex::encode(roots.end_hashes()[k]),
                want["end_hash_hex"].as_str().unwrap()
            );
        }
        for p in case["prefixes"].as_array().unwrap() {
            let n = p["n"].as_u64().unwrap();
            match p.get("error") {
                Some(_) => {
                    let err = roots.prefix(n).unwrap_err();
                    assert!(matches!(err, Error::InvalidInput(_)));
                    assert!(err.to_string().contains("outside the token sequence"));
                }
                None => check_prefix_object(&roots.prefix(n).unwrap(), &p["prefix"], name),
            }
        }
        for d in case["token_digests"].as_array().unwrap() {
            let n = d["n"].as_u64().unwrap();
            assert_eq!(
                hex::encode(roots.token_digest(n).unwrap()),
                d["digest_hex"].as_str().unwrap(),
                "{name} n={n}"
            );
        }
        if let Some(ck) = case.get("content_keys") {
            let boundaries: Vec<(u64, String)> = ck["boundaries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| (b[0].as_u64().unwrap(), b[1].as_str().unwrap().to_string()))
                .collect();
            let want: Vec<String> = ck["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap().to_string())
                .collect();
            assert_eq!(roots.content_keys(&boundaries).unwrap(), want, "{name}");
            for ((n, d), key) in boundaries.iter().zip(&want) {
                assert_eq!(&roots.content_key(*n, d).unwrap(), key);
            }
        }
        for pk in case
            .get("prefix_content_keys")
            .and_then(J::as_array)
            .into_iter()
            .flatten()
        {
            let prefix = roots.prefix(pk["n"].as_u64().unwrap()).unwrap();
            assert_eq!(
                prefix.content_key(pk["discriminator"].as_str().unwrap()),
                pk["key"].as_str().unwrap(),
                "{name}"
            );
        }
        for g in case
            .get("generations")
            .and_then(J::as_array)
            .into_iter()
            .flatten()
        {
            let prefix = roots.prefix(g["n"].as_u64().unwrap()).unwrap();
            let payload = match (g.get("payload_utf8"), g.get("payload_hex")) {
                (Some(text), _) => text.as_str().unwrap().as_bytes().to_vec(),
                (None, Some(h)) => hex::decode(h.as_str().unwrap()).unwrap(),
                _ => panic!("generation vector without payload"),
            };
            let generation = checkpoint_generation(&prefix, &payload);
            assert_eq!(generation, g["generation"].as_str().unwrap(), "{name}");
            assert!(generation.len() <= 128);
        }
    }
}

/// Parses the `tokens_repr` of a token error into the raw values (None = not an int).
fn raw_tokens(repr: &str) -> Vec<Option<i128>> {
    repr.trim_matches(['[', ']'])
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<i128>().ok())
        .collect()
}

#[test]
fn token_errors_are_refused_with_invalid_input() {
    let v = vectors();
    for case in v["token_errors"].as_array().unwrap() {
        let name = case["case"].as_str().unwrap();
        let ns = case
            .get("namespace")
            .and_then(J::as_str)
            .unwrap_or("authenticated");
        let chunk = case["chunk_tokens"].as_u64().unwrap() as u32;
        // Non-integers (True, 1.5) and out-of-range ids reach the core as an
        // invalid token, exactly as the Python binding delivers them.
        let tokens: Vec<u32> = raw_tokens(case["tokens_repr"].as_str().unwrap())
            .into_iter()
            .map(|t| match t {
                Some(t) if (0..1i128 << 32).contains(&t) => t as u32,
                _ => u32::MAX,
            })
            .collect();
        let result = TokenRoots::build(ns, tokens, chunk);
        match case["error"].as_object() {
            None => assert!(result.is_ok(), "{name}"),
            Some(err) => {
                let got = result.unwrap_err();
                assert!(matches!(got, Error::InvalidInput(_)), "{name}");
                assert_eq!(got.to_string(), err["message"].as_str().unwrap(), "{name}");
            }
        }
    }
}
