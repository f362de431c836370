//! Segment names: unguessable, carrying the owner pid; segments of dead owners are removed at
//! the next start, those of live owners are kept.

use std::collections::HashSet;
use std::path::Path;

use npu_protocol::shm::names::{owner_pid, pid_alive};
use npu_protocol::shm::{
    cleanup_stale_segments, segment_name, ShmCapacities, ShmLayout, ShmSegment, SEGMENT_PREFIX,
};

fn layout() -> ShmLayout {
    ShmLayout::new(ShmCapacities {
        max_masks: 0,
        mask_words: 0,
        max_kv_copies: 0,
        max_slots: 2,
        max_seqs_per_step: 2,
        max_tokens_per_step: 8,
        max_blocks_per_seq: 2,
        max_admissions: 2,
        max_forget: 2,
        max_top_n: 0,
    })
    .unwrap()
}

/// A pid that belonged to a process that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    assert!(!pid_alive(pid));
    pid
}

#[test]
fn names_carry_pid_and_agent_and_are_unguessable() {
    let name = segment_name(3).unwrap();
    let pid = std::process::id();
    assert!(
        name.starts_with(&format!("/{SEGMENT_PREFIX}{pid}-3-")),
        "{name}"
    );
    assert_eq!(owner_pid(&name), Some(pid));
    let random = name.rsplit('-').next().unwrap();
    assert_eq!(random.len(), 32);
    let many: HashSet<String> = (0..64).map(|_| segment_name(3).unwrap()).collect();
    assert_eq!(many.len(), 64);
}

#[test]
fn only_our_exact_name_shape_has_an_owner() {
    let hex = "0123456789abcdef0123456789abcdef";
    assert_eq!(owner_pid(&format!("/npu-serving-12-0-{hex}")), Some(12));
    assert_eq!(owner_pid(&format!("npu-serving-12-0-{hex}")), Some(12));
    for other in [
        format!("/npu-serving-12-0-{}", &hex[1..]),
        format!("/npu-serving-x-0-{hex}"),
        format!("/npu-serving-12-0-{hex}-extra"),
        format!("/other-12-0-{hex}"),
        "/npu-serving-12".to_string(),
    ] {
        assert_eq!(owner_pid(&other), None, "{other}");
    }
}

#[test]
fn pid_alive_sees_ourselves_and_not_the_dead() {
    assert!(pid_alive(std::process::id()));
    assert!(!pid_alive(dead_pid()));
    assert!(!pid_alive(0));
}

#[test]
fn segments_of_dead_owners_are_removed_and_live_ones_kept() {
    let dead = dead_pid();
    let hex: String = segment_name(9)
        .unwrap()
        .rsplit('-')
        .next()
        .unwrap()
        .to_string();
    let stale_name = format!("/{SEGMENT_PREFIX}{dead}-9-{hex}");
    // A crashed run's segment: create it, then forget it without unlinking.
    let stale = ShmSegment::create(&stale_name, &layout()).unwrap();
    std::mem::forget(stale);
    let live = ShmSegment::create(&segment_name(9).unwrap(), &layout()).unwrap();

    let removed = cleanup_stale_segments();
    assert!(removed.contains(&stale_name), "{removed:?}");
    assert!(!Path::new(&format!("/dev/shm{stale_name}")).exists());
    assert!(!removed.contains(&live.name().to_string()));
    assert!(Path::new(&format!("/dev/shm{}", live.name())).exists());
    ShmSegment::open(live.name()).unwrap();
}
