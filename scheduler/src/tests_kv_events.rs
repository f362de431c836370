//! KV events through the scheduler: the events, applied in order by a reader that starts
//! empty, rebuild exactly the prefix cache's index (which content is cached, in which tier),
//! through admissions, prefix hits, evictions, spills to the host tier, bring-backs and a reset;
//! stored blocks carry their tokens and their parent's hash; nothing is recorded unless asked.

use std::collections::HashMap;

use super::test_util::*;
use super::*;

fn cached_cfg(num_blocks: usize, block_size: usize, host_blocks: usize) -> SchedulerConfig {
    let c = SchedulerConfig {
        prefix_cache: true,
        ..cfg(num_blocks, block_size)
    };
    if host_blocks == 0 {
        c
    } else {
        host_cfg(c, host_blocks)
    }
}

/// What a reader of the events believes is cached: hash -> medium.
#[derive(Default)]
struct Reader {
    cached: HashMap<BlockHash, KvMedium>,
    stored: usize,
    removed: usize,
    cleared: usize,
}

impl Reader {
    fn apply(&mut self, s: &mut Scheduler) {
        for e in s.take_kv_events() {
            match e {
                KvEvent::Stored { hash, medium, .. } => {
                    let before = self.cached.insert(hash, medium);
                    assert_eq!(before, None, "stored twice without a removal between");
                    self.stored += 1;
                }
                KvEvent::Removed { hash, medium } => {
                    assert_eq!(
                        self.cached.remove(&hash),
                        Some(medium),
                        "removed from a medium it was not stored in"
                    );
                    self.removed += 1;
                }
                KvEvent::AllCleared => {
                    self.cached.clear();
                    self.cleared += 1;
                }
            }
        }
        let index: HashMap<BlockHash, KvMedium> = s
            .blocks
            .cached_entries()
            .into_iter()
            .map(|(h, t)| (h, t.medium()))
            .collect();
        assert_eq!(self.cached, index, "the events disagree with the index");
    }
}

fn run_to_end(s: &mut Scheduler, reader: &mut Reader) {
    while let Some(plan) = s.schedule() {
        s.on_result(&answer(&plan, |slot| 100 + slot)).unwrap();
        s.check_invariants().unwrap();
        reader.apply(s);
    }
}

#[test]
fn stored_blocks_carry_their_tokens_and_parent() {
    let mut s = sched(cached_cfg(16, 4, 0));
    s.record_kv_events();
    let p = prompt(0, 10);
    s.add(&req(1, &p, 1)).unwrap();
    let plan = s.schedule().unwrap();
    s.on_result(&answer(&plan, |_| 7)).unwrap();
    let events = s.take_kv_events();
    assert_eq!(
        events.len(),
        2,
        "two full blocks of a 10-token prompt: {events:?}"
    );
    let KvEvent::Stored {
        hash: first,
        parent: None,
        tokens,
        lora: 0,
        medium: KvMedium::Device,
    } = &events[0]
    else {
        panic!("not a first block stored on the device: {:?}", events[0]);
    };
    assert_eq!(&tokens[..], &p[..4]);
    let KvEvent::Stored { parent, tokens, .. } = &events[1] else {
        panic!("not a stored block: {:?}", events[1]);
    };
    assert_eq!((*parent, &tokens[..]), (Some(*first), &p[4..8]));
    assert!(s.take_kv_events().is_empty(), "taken events are gone");
}

#[test]
fn nothing_is_recorded_unless_asked() {
    let mut s = sched(cached_cfg(16, 4, 0));
    s.add(&req(1, &prompt(0, 10), 3)).unwrap();
    while let Some(plan) = s.schedule() {
        s.on_result(&answer(&plan, |_| 7)).unwrap();
    }
    assert!(s.take_kv_events().is_empty());
    assert!(!s.blocks.cached_entries().is_empty());
}

#[test]
fn the_events_rebuild_the_index_through_evictions_spills_and_a_reset() {
    for host_blocks in [0, 6] {
        // 8 device blocks of 4 tokens: the prompts below do not all fit, so cached blocks are
        // evicted (to the host tier when there is one) and hit again later.
        let mut s = sched(cached_cfg(8, 4, host_blocks));
        s.record_kv_events();
        let mut reader = Reader::default();
        let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i * 50, 13)).collect();
        let mut id = 0;
        for round in 0..3 {
            for p in &prompts {
                // Twice in a row: the second finds the first's blocks.
                for _ in 0..2 {
                    id += 1;
                    s.add(&req(id, p, 2)).unwrap();
                    run_to_end(&mut s, &mut reader);
                }
            }
            if round == 1 {
                // The agent's pools are gone (a restart): everything cached goes with them.
                assert!(s.take_all().is_empty());
                reader.apply(&mut s);
                assert!(reader.cached.is_empty());
            }
        }
        assert!(
            reader.removed > 0,
            "nothing was evicted (host_blocks {host_blocks})"
        );
        assert_eq!(reader.cleared, 1);
        if host_blocks > 0 {
            assert!(
                reader.cached.values().any(|m| *m == KvMedium::Host),
                "nothing spilled to the host tier"
            );
        }
        assert!(s.stats().prefix_hit_tokens > 0, "no prefix was hit again");
    }
}
