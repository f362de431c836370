//! What the emulated install reports about itself: its CANN version (`aclrtGetVersion`,
//! `aclsysGetCANNVersion`, and from 8.5 `aclsysGetVersionStr` / `aclsysGetVersionNum`) and the
//! operator package operators need (`ASCEND_OPP_PATH`, as `set_env.sh` exports it): every
//! operator's first phase fails without it ([`check_operator_package`]).

use core::ffi::c_char;

use npu_ffi::types::*;

use crate::state::*;

/// The emulated CANN version (`ASCEND_EMULATOR_CANN_VERSION`, default 8.3.RC1).
pub fn emulated_version() -> String {
    std::env::var("ASCEND_EMULATOR_CANN_VERSION").unwrap_or_else(|_| "8.3.RC1".to_string())
}

/// Operators find their kernels and tiling libraries through `ASCEND_OPP_PATH` (exported by
/// CANN's `set_env.sh`): a first phase without it naming a directory fails, as the aclnn runtime
/// does when it cannot find an operator's kernel.
pub fn check_operator_package() -> Result<(), Fail> {
    match std::env::var_os("ASCEND_OPP_PATH") {
        Some(p) if std::path::Path::new(&p).is_dir() => Ok(()),
        Some(p) => fail(
            ACLNN_ERR_INNER,
            format!(
                "ASCEND_OPP_PATH={} is not a directory: no operator kernels or tiling found",
                p.to_string_lossy()
            ),
        ),
        None => fail(
            ACLNN_ERR_INNER,
            "ASCEND_OPP_PATH is not set (CANN's set_env.sh exports it): no operator kernels or \
             tiling found",
        ),
    }
}

/// Whether the emulated release is `major.minor` or newer (`8.5.0` and `8.5.RC1` are 8.5).
pub fn emulated_release_at_least(major: u32, minor: u32) -> bool {
    release_at_least(&emulated_version(), major, minor)
}

fn release_at_least(version: &str, major: u32, minor: u32) -> bool {
    let mut parts = version.trim().split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(a), Some(b)) => (a, b) >= (major, minor),
        _ => false,
    }
}

/// # Safety
/// Out-pointers are valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetVersion(
    majorVersion: *mut i32,
    minorVersion: *mut i32,
    patchVersion: *mut i32,
) -> aclError {
    if majorVersion.is_null() || minorVersion.is_null() || patchVersion.is_null() {
        set_error("aclrtGetVersion: null out-pointer");
        return ACL_ERROR_INVALID_PARAM;
    }
    // SAFETY: checked non-null; the caller passes valid out-pointers.
    unsafe {
        *majorVersion = 1;
        *minorVersion = 13;
        *patchVersion = 0;
    }
    ACL_SUCCESS
}

/// The emulated release has the package-version entry points of CANN 8.5 and later: older
/// emulated releases answer ACL_ERROR_RT_FEATURE_NOT_SUPPORT (their real libraries lack them).
fn version_entry_points(what: &str, pkg_name: *mut c_char) -> Result<String, aclError> {
    if !emulated_release_at_least(8, 5) {
        set_error(&format!(
            "{what}: not in CANN {} (added in 8.5)",
            emulated_version()
        ));
        return Err(ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    }
    if pkg_name.is_null() {
        set_error(&format!("{what}: null pkgName"));
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    // SAFETY: non-null; the caller passes a NUL-terminated package name.
    let name = unsafe { std::ffi::CStr::from_ptr(pkg_name) }.to_string_lossy();
    if !matches!(&*name, "runtime" | "compiler" | "opp" | "toolkit") {
        set_error(&format!("{what}: package {name:?} is not installed"));
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    Ok(emulated_version())
}

/// # Safety
/// `pkgName` is a NUL-terminated string; `versionStr` holds ACL_PKG_VERSION_MAX_SIZE bytes.
#[no_mangle]
pub unsafe extern "C" fn aclsysGetVersionStr(
    pkgName: *mut c_char,
    versionStr: *mut c_char,
) -> aclError {
    let v = match version_entry_points("aclsysGetVersionStr", pkgName) {
        Ok(v) => v,
        Err(code) => return code,
    };
    if versionStr.is_null() {
        set_error("aclsysGetVersionStr: null versionStr");
        return ACL_ERROR_INVALID_PARAM;
    }
    let n = v.len().min(ACL_PKG_VERSION_MAX_SIZE - 1);
    // SAFETY: the caller's buffer holds ACL_PKG_VERSION_MAX_SIZE bytes; n + 1 fit.
    unsafe {
        std::ptr::copy_nonoverlapping(v.as_ptr().cast::<c_char>(), versionStr, n);
        *versionStr.add(n) = 0;
    }
    ACL_SUCCESS
}

/// # Safety
/// `pkgName` is a NUL-terminated string; `versionNum` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn aclsysGetVersionNum(
    pkgName: *mut c_char,
    versionNum: *mut i32,
) -> aclError {
    let v = match version_entry_points("aclsysGetVersionNum", pkgName) {
        Ok(v) => v,
        Err(code) => return code,
    };
    if versionNum.is_null() {
        set_error("aclsysGetVersionNum: null versionNum");
        return ACL_ERROR_INVALID_PARAM;
    }
    // The emulation's own weights (CANN documents only that newer releases give larger
    // numbers): major·10⁶ + minor·10⁴ + the third part·10² (an RC counts below a release).
    let mut parts = v.split('.');
    let num = |p: Option<&str>| p.and_then(|p| p.parse::<i32>().ok()).unwrap_or(0);
    let (major, minor) = (num(parts.next()), num(parts.next()));
    let third = parts.next().unwrap_or("");
    let patch = match third.strip_prefix("RC") {
        Some(rc) => num(Some(rc)),
        None => 50 + num(Some(third)),
    };
    // SAFETY: checked non-null; the caller passes a valid out-pointer.
    unsafe { *versionNum = major * 1_000_000 + minor * 10_000 + patch * 100 };
    ACL_SUCCESS
}

/// # Safety
/// `version` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclsysGetCANNVersion(
    name: aclCANNPackageName,
    version: *mut aclCANNPackageVersion,
) -> aclError {
    if version.is_null() || name > ACL_PKG_NAME_RUNTIME {
        set_error("aclsysGetCANNVersion: null out-pointer or package not emulated");
        return ACL_ERROR_INVALID_PARAM;
    }
    let v = emulated_version();
    let mut parts = v.split('.');
    // SAFETY: all-zero bytes are a valid aclCANNPackageVersion (char arrays).
    let mut out: aclCANNPackageVersion = unsafe { std::mem::zeroed() };
    let put = |dst: &mut [c_char], s: &str| {
        let n = dst.len() - 1;
        for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
            *d = b as c_char;
        }
    };
    put(&mut out.version, &v);
    put(&mut out.majorVersion, parts.next().unwrap_or(""));
    put(&mut out.minorVersion, parts.next().unwrap_or(""));
    put(&mut out.releaseVersion, parts.next().unwrap_or(""));
    // SAFETY: `version` is a valid out-pointer (checked non-null).
    unsafe { *version = out };
    ACL_SUCCESS
}

// Compile-time check: every export has the declared prototype of npu-ffi.
const _: () = {
    use npu_ffi::acl_rt::sig;
    let _: sig::aclrtGetVersion = aclrtGetVersion;
    let _: sig::aclsysGetCANNVersion = aclsysGetCANNVersion;
    let _: sig::aclsysGetVersionStr = aclsysGetVersionStr;
    let _: sig::aclsysGetVersionNum = aclsysGetVersionNum;
};

#[cfg(test)]
mod tests {
    use super::release_at_least;

    #[test]
    fn releases_compare_by_major_and_minor() {
        assert!(!release_at_least("8.3.RC1", 8, 5));
        assert!(!release_at_least("8.1.RC1", 8, 5));
        assert!(release_at_least("8.5.0", 8, 5));
        assert!(release_at_least("8.5.RC1", 8, 5));
        assert!(release_at_least("9.0.0", 8, 5));
        assert!(!release_at_least("garbage", 8, 5));
    }
}
