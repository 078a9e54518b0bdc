//! Property tests of the identity layer: roots partition the sequence,
//! `prefix(n)` equals the roots of the first n tokens, full attention page keys
//! are stable as a sequence grows, endpoint keys are endpoint-specific.

use lmcache_rc_core::TokenRoots;
use proptest::prelude::*;

fn token() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..8, 0u32..(1 << 31)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn roots_cover_the_sequence_exactly(tokens in prop::collection::vec(token(), 0..200), chunk in 1u32..40) {
        let roots = TokenRoots::build("ns", tokens.clone(), chunk).unwrap();
        let joined: Vec<u32> = roots.roots().iter().flat_map(|r| r.tail_tokens().to_vec()).collect();
        prop_assert_eq!(joined, tokens.clone());
        for (k, r) in roots.roots().iter().enumerate() {
            prop_assert_eq!(r.start_tokens(), k as u64 * u64::from(chunk));
            prop_assert!(!r.tail_tokens().is_empty());
        }
    }

    #[test]
    fn prefix_n_agrees_with_roots_of_the_first_n_tokens(
        tokens in prop::collection::vec(token(), 1..200), chunk in 1u32..40, cut in any::<prop::sample::Index>()
    ) {
        let n = cut.index(tokens.len()) + 1;
        let full = TokenRoots::build("ns", tokens.clone(), chunk).unwrap();
        let short = TokenRoots::build("ns", tokens[..n].to_vec(), chunk).unwrap();
        let last = short.roots().pop().unwrap();
        prop_assert_eq!(full.prefix(n as u64).unwrap(), last.clone());
        prop_assert_eq!(short.prefix(n as u64).unwrap(), last);
        prop_assert_eq!(full.token_digest(n as u64).unwrap(), *short.end_hashes().last().unwrap());
    }

    #[test]
    fn full_attention_page_keys_are_stable_and_endpoint_keys_are_not(
        tokens in prop::collection::vec(token(), 2..200),
        extra in prop::collection::vec(token(), 1..50),
        chunk in 1u32..40,
        block in 1u64..20,
    ) {
        let n = tokens.len() as u64;
        let mut longer = tokens.clone();
        longer.extend(&extra);
        let a = TokenRoots::build("ns", tokens.clone(), chunk).unwrap();
        let b = TokenRoots::build("ns", longer, chunk).unwrap();
        // Every full attention page of the shorter sequence keeps its key.
        let mut end = block;
        while end <= n {
            prop_assert_eq!(a.content_key(end, "attention:0").unwrap(), b.content_key(end, "attention:0").unwrap());
            end += block;
        }
        // Recurrent / auxiliary keys belong to one endpoint: a different endpoint never shares them.
        let m = b.len() as u64;
        prop_assert_ne!(a.content_key(n, "recurrent:1").unwrap(), b.content_key(m, "recurrent:1").unwrap());
        prop_assert_ne!(a.content_key(n, "auxiliary:0:prompt").unwrap(), b.content_key(m, "auxiliary:0:prompt").unwrap());
        prop_assert_ne!(a.content_key(n, "recurrent:1").unwrap(), a.content_key(n - 1, "recurrent:1").unwrap());
        // Different discriminators never collide.
        prop_assert_ne!(a.content_key(n, "attention:0").unwrap(), a.content_key(n, "recurrent:0").unwrap());
    }
}
