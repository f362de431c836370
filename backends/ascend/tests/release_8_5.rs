//! The emulation reporting CANN 8.5.0 (its own test binary: the reported release is read from
//! the process environment): the version comes through `aclsysGetVersionStr` (the entry point
//! 8.5 added, preferred to the deprecated `aclsysGetCANNVersion`), and RmsNorm takes an f32
//! gamma with f16 x, a combination the 8.5 page lists.

mod common;

use common::*;
use npu_backend_ascend::ops::OpRunner;
use npu_backend_ascend::tensor::DType;

#[test]
fn cann_8_5_reports_its_version_by_package_and_takes_f32_gamma() {
    std::env::set_var("ASCEND_EMULATOR_CANN_VERSION", "8.5.0");
    let acl = acl();
    assert_eq!(acl.version.to_string(), "8.5.0");
    let get = acl
        .api
        .rt
        .aclsysGetVersionStr
        .expect("declared and exported");
    let mut pkg = *b"runtime\0";
    let mut buf = [0 as std::ffi::c_char; npu_ffi::types::ACL_PKG_VERSION_MAX_SIZE];
    // SAFETY: a NUL-terminated name and a buffer of the documented size.
    assert_eq!(unsafe { get(pkg.as_mut_ptr().cast(), buf.as_mut_ptr()) }, 0);
    // SAFETY: the emulation wrote a NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    assert_eq!(s.to_str().unwrap(), "8.5.0");
    let mut n = 0;
    let num = acl.api.rt.aclsysGetVersionNum.unwrap();
    // SAFETY: as above; a valid out-pointer.
    assert_eq!(unsafe { num(pkg.as_mut_ptr().cast(), &mut n) }, 0);
    assert!(n > 8_030_000, "{n}");

    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (rows, dim) = (2i64, 32i64);
    let xb = upload_f16(&vec![2.0; (rows * dim) as usize]);
    let gb = upload(
        &[1.0f32; 32]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let (yb, rb) = (zeros((rows * dim * 2) as usize), zeros((rows * 4) as usize));
    ops.rms_norm(
        &t(&xb, DType::F16, &[rows, dim]),
        &t(&gb, DType::F32, &[dim]),
        1e-6,
        &t(&yb, DType::F16, &[rows, dim]),
        &t(&rb, DType::F32, &[rows, 1]),
    )
    .expect("f32 gamma with f16 x in CANN 8.5");
    dev.synchronize().unwrap();
    assert!(read_f16(&yb, 64).iter().all(|&v| (v - 1.0).abs() < 1e-3));
}
