//! The bounded in-memory store of the Responses API: each stored response with the
//! conversation it ends (its inputs, those of the responses it continued, and its output), so
//! that `GET /v1/responses/{id}` reads it back and `previous_response_id` continues it. Holds at
//! most `store_size` responses (the oldest evicted first) for `ttl` each; one lock, held only
//! to copy an entry in or out.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    /// The whole response object, as `GET /v1/responses/{id}` returns it.
    pub response: Value,
    /// This request's own input items (canonical form, each with an id).
    pub input: Vec<Value>,
    /// The conversation so far: the earlier responses' items, this input, this output.
    pub history: Vec<Value>,
}

struct Inner {
    /// id -> (insertion number, when stored, entry).
    entries: HashMap<String, (u64, Instant, Entry)>,
    /// insertion number -> id, oldest first.
    order: BTreeMap<u64, String>,
    next: u64,
}

pub(crate) struct Store {
    cap: usize,
    ttl: Duration,
    inner: Mutex<Inner>,
}

impl Store {
    pub fn new(cap: usize, ttl: Duration) -> Self {
        Self {
            cap: cap.max(1),
            ttl,
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                order: BTreeMap::new(),
                next: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves consistent maps: keep using them.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops what has outlived the TTL (the oldest come first).
    fn expire(&self, inner: &mut Inner, now: Instant) {
        while let Some((&n, id)) = inner.order.iter().next() {
            let old = inner
                .entries
                .get(id)
                .is_none_or(|(_, at, _)| now.duration_since(*at) >= self.ttl);
            if !old {
                break;
            }
            let id = id.clone();
            inner.order.remove(&n);
            inner.entries.remove(&id);
        }
    }

    pub fn insert(&self, id: String, entry: Entry) {
        let now = Instant::now();
        let mut inner = self.lock();
        self.expire(&mut inner, now);
        if let Some((n, _, _)) = inner.entries.remove(&id) {
            inner.order.remove(&n);
        }
        while inner.entries.len() >= self.cap {
            let Some((_, old)) = inner.order.pop_first() else {
                break;
            };
            inner.entries.remove(&old);
        }
        let n = inner.next;
        inner.next += 1;
        inner.order.insert(n, id.clone());
        inner.entries.insert(id, (n, now, entry));
    }

    pub fn get(&self, id: &str) -> Option<Entry> {
        let mut inner = self.lock();
        self.expire(&mut inner, Instant::now());
        inner.entries.get(id).map(|(_, _, e)| e.clone())
    }

    /// Whether there was such a response.
    pub fn remove(&self, id: &str) -> bool {
        let mut inner = self.lock();
        self.expire(&mut inner, Instant::now());
        match inner.entries.remove(id) {
            Some((n, _, _)) => {
                inner.order.remove(&n);
                true
            }
            None => false,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry(n: u64) -> Entry {
        Entry {
            response: json!({"n": n}),
            input: Vec::new(),
            history: Vec::new(),
        }
    }

    #[test]
    fn the_oldest_is_evicted_first_and_removal_frees_a_place() {
        let s = Store::new(3, Duration::from_secs(3600));
        for n in 0..5 {
            s.insert(format!("r{n}"), entry(n));
        }
        assert_eq!(s.len(), 3);
        assert!(s.get("r0").is_none() && s.get("r1").is_none());
        assert_eq!(s.get("r4").unwrap().response["n"], 4);
        assert!(s.remove("r3"));
        assert!(!s.remove("r3"));
        s.insert("r5".into(), entry(5));
        assert!(
            s.get("r2").is_some(),
            "a removal made room: nothing evicted"
        );
        // Storing an id again replaces it and makes it the newest.
        s.insert("r2".into(), entry(22));
        s.insert("r6".into(), entry(6));
        assert!(s.get("r4").is_none());
        assert_eq!(s.get("r2").unwrap().response["n"], 22);
    }

    #[test]
    fn responses_past_the_ttl_are_gone() {
        let s = Store::new(10, Duration::from_millis(30));
        s.insert("a".into(), entry(1));
        assert!(s.get("a").is_some());
        std::thread::sleep(Duration::from_millis(60));
        assert!(s.get("a").is_none());
        assert_eq!(s.len(), 0);
    }
}
