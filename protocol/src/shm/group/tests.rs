use super::*;
use crate::shm::segment_name;

fn region(ranks: u32, floats: u64) -> GroupRegion {
    let name = segment_name(GROUP_REGION_ID_BASE + 7).unwrap();
    GroupRegion::create(&name, ranks, floats).unwrap()
}

fn join_all(region: &GroupRegion, wait: Duration) -> Vec<GroupMember> {
    let ranks = region.ranks();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let name = region.name().to_string();
                s.spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    GroupRegion::open(&name)
                        .unwrap()
                        .join(r, wait, deadline)
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_header_is_checked() {
    let r = region(2, 100);
    assert_eq!(r.slot_floats(), 112);
    let o = GroupRegion::open(r.name()).unwrap();
    assert_eq!((o.ranks(), o.layout_hash()), (2, r.layout_hash()));
    let path = format!("/dev/shm{}", r.name());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[16] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        GroupRegion::open(r.name()),
        Err(ShmError::LayoutMismatch(_))
    ));
    bytes[0] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        GroupRegion::open(r.name()),
        Err(ShmError::BadMagic { .. })
    ));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(GroupLayout::new(0, 10).is_err());
    assert!(GroupLayout::new(MAX_GROUP_RANKS + 1, 10).is_err());
}

#[test]
fn sums_and_gathers_in_rank_order_in_several_rounds() {
    for ranks in [1u32, 2, 3] {
        let r = region(ranks, 16);
        let members = join_all(&r, Duration::from_secs(10));
        type Out = (Vec<f32>, Vec<f32>, Option<Vec<f32>>);
        let results: Vec<Out> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|mut m| {
                    s.spawn(move || {
                        let rank = m.rank() as f32;
                        // 40 values: three rounds of 16.
                        let mut x: Vec<f32> = (0..40).map(|i| i as f32 + rank * 0.5).collect();
                        for _ in 0..5 {
                            m.barrier().unwrap();
                        }
                        m.all_reduce_sum(&mut x).unwrap();
                        let mine: Vec<f32> = (0..20).map(|i| rank * 100.0 + i as f32).collect();
                        let mut all = vec![0f32; 20 * ranks as usize];
                        m.all_gather(&mine, &mut all).unwrap();
                        let mut root = vec![0f32; 20 * ranks as usize];
                        let out = (m.rank() == 0).then_some(&mut root[..]);
                        m.gather_to_root(&mine, out).unwrap();
                        (x, all, (m.rank() == 0).then_some(root))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let n = ranks as f32;
        let half_sum: f32 = (0..ranks).map(|r| r as f32 * 0.5).sum();
        for (x, all, root) in &results {
            for (i, v) in x.iter().enumerate() {
                assert_eq!(*v, i as f32 * n + half_sum, "ranks {ranks}");
            }
            for r in 0..ranks as usize {
                for i in 0..20 {
                    assert_eq!(all[r * 20 + i], r as f32 * 100.0 + i as f32);
                }
            }
            if let Some(root) = root {
                assert_eq!(root, all);
            }
        }
        // Every rank holds the same bits.
        assert!(results.windows(2).all(|w| w[0].0 == w[1].0));
    }
}

#[test]
fn a_dead_peer_is_noticed_instead_of_waiting_for_ever() {
    let r = region(2, 16);
    // Rank 1 is a process that "joined" and exits without arriving; it stays a zombie
    // (not reaped) while rank 0 waits.
    let mut child = std::process::Command::new("sleep")
        .arg("0.3")
        .spawn()
        .unwrap();
    let pid = child.id();
    r.mark_joined(1, pid);
    let mut m = GroupRegion::open(r.name())
        .unwrap()
        .join(
            0,
            Duration::from_secs(60),
            Instant::now() + Duration::from_secs(10),
        )
        .unwrap();
    let started = Instant::now();
    let e = m.all_reduce_sum(&mut [1.0; 8]).unwrap_err();
    assert!(
        matches!(e, GroupError::PeerDied { rank: 1, pid: p } if p == pid),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(m.barrier(), Err(GroupError::Poisoned)));
    child.wait().unwrap();
}

#[test]
fn a_late_peer_times_out_and_an_abort_stops_the_others() {
    let r = region(3, 16);
    let mut members = join_all(&r, Duration::from_millis(200));
    let mut m2 = members.pop().unwrap();
    let mut m1 = members.pop().unwrap();
    let mut m0 = members.pop().unwrap();
    // Rank 2 never arrives: the others give up at their deadline, naming it.
    let e = std::thread::scope(|s| {
        let h = s.spawn(|| m1.barrier());
        let e0 = m0.barrier().unwrap_err();
        let e1 = h.join().unwrap().unwrap_err();
        (e0, e1)
    });
    let text = format!("{} / {}", e.0, e.1);
    assert!(
        text.contains("[2]") || text.contains("rank 0") || text.contains("rank 1"),
        "{text}"
    );
    // Rank 2 sees the abort at once.
    let started = Instant::now();
    let e = m2.barrier().unwrap_err();
    assert!(matches!(e, GroupError::Aborted { .. }), "{e}");
    assert!(started.elapsed() < Duration::from_millis(150));
}

#[test]
fn joining_waits_for_every_rank_until_its_deadline() {
    let r = region(2, 16);
    let e = GroupRegion::open(r.name())
        .unwrap()
        .join(
            0,
            Duration::from_secs(1),
            Instant::now() + Duration::from_millis(50),
        )
        .unwrap_err();
    assert!(
        matches!(e, GroupError::Timeout { ref missing, .. } if missing == &[1]),
        "{e}"
    );
    let e = GroupRegion::open(r.name())
        .unwrap()
        .join(0, Duration::from_secs(1), Instant::now())
        .unwrap_err();
    assert!(e.to_string().contains("joined this region already"), "{e}");
}
