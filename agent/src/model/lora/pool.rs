//! Which adapter sits in which of a model's fixed LoRA slots: adapters are placed on demand,
//! pinned while a running request uses them, and the least recently used unpinned one is
//! evicted when a new one needs a slot. When every slot is pinned the answer is to wait (a
//! request is never failed for want of a slot).

/// What `acquire` decided for an adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// Already in this slot (0-based); pinned once more.
    Resident(usize),
    /// Load it into this slot (pinned), after unloading `evicted` from it when set.
    Load {
        slot: usize,
        evicted: Option<String>,
    },
    /// Every slot is pinned by running requests: try again after one releases.
    Wait,
}

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    pins: usize,
    last_used: u64,
}

/// The slots' occupants, by adapter name.
#[derive(Debug, Clone)]
pub struct SlotPool {
    slots: Vec<Option<Entry>>,
    clock: u64,
}

impl SlotPool {
    pub fn new(n: usize) -> Self {
        Self {
            slots: vec![None; n],
            clock: 0,
        }
    }

    /// The slot `name` is in, if any.
    pub fn slot_of(&self, name: &str) -> Option<usize> {
        self.slots
            .iter()
            .position(|e| e.as_ref().is_some_and(|e| e.name == name))
    }

    /// Pins `name` for one request: in place, or given a free slot, or the least recently used
    /// unpinned one's; `Wait` when every slot is pinned.
    pub fn acquire(&mut self, name: &str) -> Acquire {
        self.clock += 1;
        if let Some(s) = self.slot_of(name) {
            let e = self.slots[s].as_mut().expect("slot_of found it");
            e.pins += 1;
            e.last_used = self.clock;
            return Acquire::Resident(s);
        }
        let free = self.slots.iter().position(Option::is_none);
        let victim = free.or_else(|| {
            self.slots
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.as_ref().filter(|e| e.pins == 0).map(|e| (e.last_used, i)))
                .min()
                .map(|(_, i)| i)
        });
        let Some(slot) = victim else {
            return Acquire::Wait;
        };
        let evicted = self.slots[slot].take().map(|e| e.name);
        self.slots[slot] = Some(Entry {
            name: name.to_string(),
            pins: 1,
            last_used: self.clock,
        });
        Acquire::Load { slot, evicted }
    }

    /// Unpins `name` once (a request using it finished).
    pub fn release(&mut self, name: &str) {
        if let Some(s) = self.slot_of(name) {
            let e = self.slots[s].as_mut().expect("slot_of found it");
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Removes `name` from its slot (an adapter unloaded by the API); refused while pinned.
    /// Returns the slot it left.
    pub fn remove(&mut self, name: &str) -> Result<Option<usize>, String> {
        let Some(s) = self.slot_of(name) else {
            return Ok(None);
        };
        let pins = self.slots[s].as_ref().map_or(0, |e| e.pins);
        if pins > 0 {
            return Err(format!(
                "adapter {name:?} is in use by {pins} running requests"
            ));
        }
        self.slots[s] = None;
        Ok(Some(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_pins_evicts_the_least_recently_used_and_waits_when_all_are_pinned() {
        let mut p = SlotPool::new(2);
        assert_eq!(
            p.acquire("a"),
            Acquire::Load {
                slot: 0,
                evicted: None
            }
        );
        assert_eq!(
            p.acquire("b"),
            Acquire::Load {
                slot: 1,
                evicted: None
            }
        );
        // Both pinned: a third waits.
        assert_eq!(p.acquire("c"), Acquire::Wait);
        assert_eq!(p.acquire("a"), Acquire::Resident(0));
        p.release("b");
        // b is unpinned and least recently used: c takes its slot.
        assert_eq!(
            p.acquire("c"),
            Acquire::Load {
                slot: 1,
                evicted: Some("b".into())
            }
        );
        assert!(p.remove("a").is_err(), "a is pinned twice");
        p.release("a");
        p.release("a");
        p.release("c");
        // a used before c: a goes first.
        assert_eq!(
            p.acquire("d"),
            Acquire::Load {
                slot: 0,
                evicted: Some("a".into())
            }
        );
        p.release("d");
        assert_eq!(p.remove("d"), Ok(Some(0)));
        assert_eq!(p.slot_of("d"), None);
    }
}
