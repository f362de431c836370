//! The KV handoff region: created by one side and opened by another, blocks written through
//! one mapping read back through the other, headers checked on open (magic, version, layout
//! hash, size), block ids past the end refused.

use npu_protocol::shm::handoff::{HandoffHeader, HANDOFF_DATA_OFFSET};
use npu_protocol::shm::{handoff_blocks, segment_name, HandoffRegion, ShmError, HANDOFF_REGION_ID};

#[test]
fn blocks_written_by_one_mapping_are_read_by_another() {
    let name = segment_name(HANDOFF_REGION_ID).unwrap();
    let mut server = HandoffRegion::create(&name, 10_000).unwrap();
    assert_eq!(server.blocks(3000), 3);
    assert_eq!(handoff_blocks(10_000, 0), 0);
    let mut a = HandoffRegion::open(&name).unwrap();
    let b = HandoffRegion::open(&name).unwrap();
    assert_eq!((a.data_bytes(), b.data_bytes()), (10_000, 10_000));
    a.block_mut(2, 3000).unwrap().fill(7);
    a.block_mut(0, 3000).unwrap()[..4].copy_from_slice(&[1, 2, 3, 4]);
    assert!(b.block(2, 3000).unwrap().iter().all(|&x| x == 7));
    assert_eq!(&b.block(0, 3000).unwrap()[..5], &[1, 2, 3, 4, 0]);
    assert!(b.block(1, 3000).unwrap().iter().all(|&x| x == 0));
    // Past the end: an error, never a short or out-of-bounds slice.
    assert!(matches!(a.block_mut(3, 3000), Err(ShmError::BadPlan(_))));
    assert!(matches!(b.block(0, 20_000), Err(ShmError::BadPlan(_))));
    // A second create of the same name fails; the creator's drop removes the name.
    assert!(HandoffRegion::create(&name, 10).is_err());
    server.block_mut(1, 3000).unwrap().fill(1);
    drop(server);
    assert!(HandoffRegion::open(&name).is_err());
    // Mappings already open stay valid.
    assert!(b.block(1, 3000).unwrap().iter().all(|&x| x == 1));
}

#[test]
fn a_region_with_a_bad_header_is_refused() {
    let name = segment_name(HANDOFF_REGION_ID).unwrap();
    let _region = HandoffRegion::create(&name, 4096).unwrap();
    let path = format!("/dev/shm{name}");
    let good = std::fs::read(&path).unwrap();
    let header_len = std::mem::size_of::<HandoffHeader>();
    let corrupt = |offset: usize, what: &str| {
        let mut bytes = good.clone();
        bytes[offset] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let e = HandoffRegion::open(&name).unwrap_err();
        std::fs::write(&path, &good).unwrap();
        assert!(e.to_string().contains(what), "{what}: {e}");
    };
    corrupt(0, "magic");
    corrupt(8, "version");
    corrupt(16, "layout");
    corrupt(32, "layout");
    assert!(header_len as u64 <= HANDOFF_DATA_OFFSET);
    HandoffRegion::open(&name).unwrap();
    assert!(HandoffRegion::create("no-slash", 10).is_err());
    assert!(HandoffRegion::create(&segment_name(HANDOFF_REGION_ID).unwrap(), 1 << 40).is_err());
}
