//! Tests of the block manager: allocation, prefix sharing, LRU eviction, and the host tier
//! (spills, hits brought back, swap-out and swap-in copies in order).

use super::*;

fn dev(ids: &[u32]) -> Vec<Tier> {
    ids.iter().map(|&b| Tier::Device(b)).collect()
}

fn ids(tiers: &[Tier]) -> Vec<u32> {
    tiers
        .iter()
        .map(|t| match t {
            Tier::Device(b) | Tier::Host(b) => *b,
        })
        .collect()
}

fn holders(m: &BlockManager, tables: &[&[u32]]) -> Vec<u32> {
    let mut h = vec![0; m.num_total()];
    for t in tables {
        for &b in *t {
            h[b as usize] += 1;
        }
    }
    h
}

#[test]
fn allocation_is_all_or_nothing_and_release_frees() {
    let mut m = BlockManager::new(4, 2, false);
    let a = m.allocate_many(3).unwrap();
    assert_eq!(m.num_used(), 3);
    assert!(m.allocate_many(2).is_none());
    assert_eq!(m.num_used(), 3, "a failed allocation takes nothing");
    m.check(&holders(&m, &[&a])).unwrap();
    m.release_table(&a);
    assert_eq!(m.num_free(), 4);
    m.check(&holders(&m, &[])).unwrap();
}

#[test]
fn registered_blocks_are_found_shared_and_counted() {
    let mut m = BlockManager::new(4, 2, true);
    let tokens = [1, 2, 3, 4, 5];
    let t = m.allocate_many(3).unwrap();
    let h0 = m.register(t[0], None, 0, &tokens[0..2]);
    m.register(t[1], Some(h0), 0, &tokens[2..4]);
    let hit = m.find_prefix(&tokens, 0, 8);
    assert_eq!(hit.blocks, dev(&t[..2]));
    assert_eq!(hit.revived, 0);
    m.hold(&hit.blocks);
    assert_eq!(m.refs(t[0]), 2);
    m.check(&holders(&m, &[&t, &ids(&hit.blocks)])).unwrap();
    // A different second block only matches the first.
    let other = m.find_prefix(&[1, 2, 3, 9], 0, 8);
    assert_eq!(other.blocks, dev(&t[..1]));
    // The same second block after a different first block is no hit at all.
    assert!(m.find_prefix(&[7, 2, 3, 4], 0, 8).blocks.is_empty());
    // max_blocks limits the hit.
    assert_eq!(m.find_prefix(&tokens, 0, 1).blocks, dev(&t[..1]));
}

#[test]
fn released_cached_blocks_stay_until_evicted_lru() {
    let mut m = BlockManager::new(3, 1, true);
    let a = m.allocate().unwrap();
    let b = m.allocate().unwrap();
    m.register(a, None, 0, &[10]);
    m.register(b, None, 0, &[20]);
    m.release(a); // a released first: evicted first
    m.release(b);
    assert_eq!(m.num_evictable(), 2);
    assert_eq!(m.num_available(), 3);
    m.check(&holders(&m, &[])).unwrap();
    let hit = m.find_prefix(&[20], 0, 1);
    assert_eq!((hit.blocks.clone(), hit.revived), (dev(&[b]), 1));
    let free_one = m.allocate().unwrap();
    assert!(
        free_one != a && free_one != b,
        "free blocks go before cached ones"
    );
    let evicted = m.allocate().unwrap();
    assert_eq!(
        evicted, a,
        "least recently released cached block is evicted first"
    );
    assert!(
        m.find_prefix(&[10], 0, 1).blocks.is_empty(),
        "evicted content is forgotten"
    );
    assert_eq!(m.find_prefix(&[20], 0, 1).blocks, dev(&[b]));
    m.check(&holders(&m, &[&[free_one, evicted]])).unwrap();
}

#[test]
fn duplicate_content_stays_private() {
    let mut m = BlockManager::new(2, 2, true);
    let a = m.allocate().unwrap();
    let b = m.allocate().unwrap();
    let ha = m.register(a, None, 0, &[1, 2]);
    let hb = m.register(b, None, 0, &[1, 2]);
    assert_eq!(ha, hb);
    assert!(m.is_cached(a) && !m.is_cached(b));
    m.release(b);
    assert_eq!(m.num_free(), 1);
    m.check(&holders(&m, &[&[a]])).unwrap();
}

#[test]
fn caching_off_never_shares() {
    let mut m = BlockManager::new(2, 1, false);
    let a = m.allocate().unwrap();
    m.register(a, None, 0, &[5]);
    assert!(!m.is_cached(a));
    assert!(m.find_prefix(&[5], 0, 1).blocks.is_empty());
    m.release(a);
    assert_eq!(m.num_free(), 2);
}
