//! An agent's exit: the backend and every buffer dropped, then `aclFinalize` once — with nothing
//! left alive in the emulation, and the runtime refusing to start again. Its own test binary:
//! finalizing ends ACL for the process.

mod common;

use npu_backend::{Backend, DType, HostSlice, ViewMut};
use npu_backend_ascend::{Acl, AscendBackend, AscendConfig};

#[test]
fn finalize_after_the_last_device_closes_leaves_nothing_alive() {
    let acl = common::acl();
    let mut b = AscendBackend::with_runtime(acl, AscendConfig::default()).unwrap();
    let mut buf = b.alloc(DType::F16, 8).unwrap();
    b.upload(
        HostSlice::F32(&[1.0; 8]),
        ViewMut::rows(&mut buf, 1, 8).unwrap(),
    )
    .unwrap();
    drop(buf);
    drop(b);
    Acl::finalize().unwrap();
    // Twice is harmless.
    Acl::finalize().unwrap();
    assert!(
        common::leak_report().is_empty(),
        "{}",
        common::leak_report()
    );
    let e = AscendBackend::with_runtime(acl, AscendConfig::default());
    assert!(e.is_err(), "a device opened after aclFinalize");
    let e = Acl::init(&npu_ffi::SearchPaths::root(&common::emulator_root()))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("finalized"), "{e}");
}
