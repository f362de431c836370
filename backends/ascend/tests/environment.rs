//! Starting from an install root alone, as a user who set only `ASCEND_HOME_PATH` would (CANN's
//! `set_env.sh` not sourced): the runtime sets the operator-package variables `set_env.sh`
//! exports from the root before `aclInit`, so the first operator finds its kernels (the
//! emulation refuses every operator while `ASCEND_OPP_PATH` names no directory). Its own test
//! binary: it changes the process environment before ACL starts.

mod common;

use std::path::PathBuf;

use npu_backend::{Backend, DType, HostSlice, HostTensor, Layout, View, ViewMut};
use npu_backend_ascend::{Acl, AscendBackend, AscendConfig};
use npu_gguf::GgmlType;

#[test]
fn a_root_without_set_env_gets_its_operator_package_variables_before_acl_starts() {
    let root = common::emulator_root();
    std::env::remove_var("ASCEND_OPP_PATH");
    std::env::remove_var("ASCEND_AICPU_PATH");
    let acl = Acl::init(&npu_ffi::SearchPaths::root(&root)).expect("CANN starts");
    assert_eq!(
        std::env::var_os("ASCEND_OPP_PATH").map(PathBuf::from),
        Some(root.join("opp"))
    );
    assert_eq!(
        std::env::var_os("ASCEND_AICPU_PATH").map(PathBuf::from),
        Some(root.clone())
    );
    // An operator runs (RmsNorm over one row).
    let mut b = AscendBackend::with_runtime(acl, AscendConfig::default()).unwrap();
    let mut x = b.alloc(DType::F16, 32).unwrap();
    b.upload(
        HostSlice::F32(&[2.0; 32]),
        ViewMut::rows(&mut x, 1, 32).unwrap(),
    )
    .unwrap();
    let w: Vec<u8> = [1.0f32; 32].iter().flat_map(|v| v.to_le_bytes()).collect();
    let g = b
        .load_vector(HostTensor {
            ty: GgmlType::F32,
            data: &w,
            rows: 1,
            cols: 32,
        })
        .unwrap();
    let mut y = b.alloc(DType::F16, 32).unwrap();
    b.rms_norm(
        View::rows(&x, 1, 32).unwrap(),
        &g,
        1e-6,
        ViewMut::rows(&mut y, 1, 32).unwrap(),
    )
    .expect("the first operator finds its kernels");
    let mut got = [0f32; 32];
    b.read_back(&mut [npu_backend::Readback {
        src: View::new(&y, Layout::contiguous(1, 32)).unwrap(),
        dst: npu_backend::HostSliceMut::F32(&mut got),
    }])
    .unwrap();
    assert!(got.iter().all(|&v| (v - 1.0).abs() < 1e-3), "{got:?}");

    // Without the variable the emulation refuses operators, as CANN fails to find kernels.
    std::env::remove_var("ASCEND_OPP_PATH");
    let e = b
        .rms_norm(
            View::rows(&x, 1, 32).unwrap(),
            &g,
            1e-6,
            ViewMut::rows(&mut y, 1, 32).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("ASCEND_OPP_PATH"), "{e}");
    std::env::set_var("ASCEND_OPP_PATH", root.join("opp"));
}
