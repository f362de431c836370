//! CUDA 13 and CUDA 12 from one build (review findings 1, 2 and 4): NVRTC and cuBLAS are found
//! by the sonames of 13 then 12, never newer than the driver runs, where the pip wheels and the
//! toolkits install them, with what they open by name loaded first from the same directory.
//!
//! The installs are stand-ins: tiny shared libraries built here with the C compiler, with the
//! real sonames, entry points and dependencies, laid out as the wheels and toolkits lay them out
//! (`pip download` of nvidia-cuda-nvrtc 13.5 / -cu12 12.9 and nvidia-cublas 13.10 / -cu12 12.9):
//!
//! - CUDA 13 wheels: `site-packages/nvidia/cu13/lib/` holds `libnvrtc.so.13`,
//!   `libnvrtc-builtins.so.13.M`, `libcublas.so.13`, `libcublasLt.so.13`;
//! - CUDA 12 wheels: `nvidia/cuda_nvrtc/lib/` (`libnvrtc.so.12`, `libnvrtc-builtins.so.12.M`)
//!   and `nvidia/cublas/lib/` (`libcublas.so.12`, `libcublasLt.so.12`);
//! - toolkits: `lib64/` or `targets/<arch>-linux/lib/` with `libnvrtc.so.12.4.127` and its
//!   soname link, and so on.
//!
//! The stand-in NVRTC opens `libnvrtc-builtins.so.M.m` by name when it compiles, as the real
//! one does, and fails with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE (7) when it cannot; the
//! stand-in cuBLAS needs `libcublasLt.so.M` (no run path, as in a toolkit's lib64). Each case
//! runs in its own process: what one loads (by soname) would be found by the next.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use npu_backend_cuda::cublas::CublasApi;
use npu_backend_cuda::libs::{self, CudaLib, Search};
use npu_backend_cuda::nvrtc::{NvrtcApi, Target};

const CHILD: &str = "NPU_CUDA_VERSIONS_CHILD";
const ROOT: &str = "NPU_CUDA_VERSIONS_ROOT";

const NVRTC_C: &str = r#"
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>
static int the_prog;
int nvrtcVersion(int* a, int* b) { *a = MAJOR; *b = MINOR; return 0; }
const char* nvrtcGetErrorString(int r) {
    return r == 0 ? "NVRTC_SUCCESS" : r == 7 ? "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE" : "NVRTC_ERROR";
}
int nvrtcGetNumSupportedArchs(int* n) { *n = 4; return 0; }
int nvrtcGetSupportedArchs(int* a) { a[0] = 80; a[1] = 86; a[2] = 89; a[3] = 90; return 0; }
int nvrtcCreateProgram(void** p, const char* s, const char* n, int k, const char* const* h,
                       const char* const* i) { *p = &the_prog; return 0; }
int nvrtcDestroyProgram(void** p) { *p = 0; return 0; }
static int compiled;
int nvrtcCompileProgram(void* p, int n, const char* const* o) {
    /* As the real NVRTC: the builtins library is opened by name at the first compile. */
    void* h = dlopen(BUILTINS, RTLD_NOW);
    if (!h) return 7;
    compiled = 1;
    return 0;
}
static const char LOG[] = "stand-in: failed to open " BUILTINS;
int nvrtcGetProgramLogSize(void* p, size_t* n) { *n = sizeof LOG; return 0; }
int nvrtcGetProgramLog(void* p, char* s) { memcpy(s, LOG, sizeof LOG); return 0; }
static const char PTX[] = "// stand-in PTX\n.version 8.0\n";
int nvrtcGetPTXSize(void* p, size_t* n) { *n = sizeof PTX; return 0; }
int nvrtcGetPTX(void* p, char* s) { memcpy(s, PTX, sizeof PTX); return 0; }
static const char CUBIN[] = "\x7f" "ELF stand-in cubin";
int nvrtcGetCUBINSize(void* p, size_t* n) { *n = sizeof CUBIN; return 0; }
int nvrtcGetCUBIN(void* p, char* s) { memcpy(s, CUBIN, sizeof CUBIN); return 0; }
"#;

const BUILTINS_C: &str = "int nvrtc_builtins_stand_in(void) { return 1; }\n";

const CUBLAS_LT_C: &str = "int cublasLtGetVersion(void) { return MAJOR * 10000 + MINOR * 100; }\n";

const CUBLAS_C: &str = r#"
extern int cublasLtGetVersion(void);
int cublasGetProperty(int type, int* v) {
    int lt = cublasLtGetVersion();
    *v = type == 0 ? lt / 10000 : type == 1 ? (lt / 100) % 100 : 7;
    return 0;
}
static int handle;
int cublasCreate_v2(void** h) { *h = &handle; return 0; }
int cublasDestroy_v2(void* h) { return 0; }
int cublasSetStream_v2(void* h, void* s) { return 0; }
int cublasGemmEx(void) { return 15; }
const char* cublasGetStatusString(int s) { return s == 0 ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_NOT_SUPPORTED"; }
"#;

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

fn compile(src: &str, out: &Path, soname: &str, defs: &[String], link: &[PathBuf]) -> bool {
    let dir = out.parent().unwrap();
    let c = dir.join(format!("{soname}.c"));
    std::fs::write(&c, src).unwrap();
    let st = Command::new(cc())
        .args(["-shared", "-fPIC", "-O0", "-w"])
        .arg(format!("-Wl,-soname,{soname}"))
        .args(defs)
        .arg("-o")
        .arg(out)
        .arg(&c)
        .args(link)
        .arg("-ldl")
        .status();
    matches!(st, Ok(s) if s.success())
}

/// Builds the stand-in libraries of one CUDA version into `root/<major>.<minor>/`; `None` when
/// no C compiler runs.
fn build_version(root: &Path, major: u32, minor: u32) -> Option<PathBuf> {
    let d = root.join(format!("{major}.{minor}"));
    std::fs::create_dir_all(&d).unwrap();
    let defs = vec![
        format!("-DMAJOR={major}"),
        format!("-DMINOR={minor}"),
        format!("-DBUILTINS=\"libnvrtc-builtins.so.{major}.{minor}\""),
    ];
    let builtins = format!("libnvrtc-builtins.so.{major}.{minor}");
    let ok = compile(BUILTINS_C, &d.join(&builtins), &builtins, &defs, &[])
        && compile(
            NVRTC_C,
            &d.join(format!("libnvrtc.so.{major}")),
            &format!("libnvrtc.so.{major}"),
            &defs,
            &[],
        )
        && compile(
            CUBLAS_LT_C,
            &d.join(format!("libcublasLt.so.{major}")),
            &format!("libcublasLt.so.{major}"),
            &defs,
            &[],
        )
        && compile(
            CUBLAS_C,
            &d.join(format!("libcublas.so.{major}")),
            &format!("libcublas.so.{major}"),
            &defs,
            &[d.join(format!("libcublasLt.so.{major}"))],
        );
    ok.then_some(d)
}

/// The stand-ins of CUDA 13.0, 12.9 (the wheels) and 12.4 (a toolkit), built once per test
/// process; `None` (reason printed) without a C compiler.
fn standins() -> Option<&'static PathBuf> {
    static ROOT_DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    ROOT_DIR
        .get_or_init(|| {
            let root =
                std::env::temp_dir().join(format!("npu-cuda-standins-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            let built = [(13, 0), (12, 9), (12, 4)]
                .iter()
                .all(|&(a, b)| build_version(&root, a, b).is_some());
            if !built {
                eprintln!(
                    "SKIPPED: no C compiler (`{}`) to build the stand-in libraries",
                    cc()
                );
                return None;
            }
            Some(root)
        })
        .as_ref()
}

fn copy(from: &Path, to_dir: &Path, names: &[&str]) {
    std::fs::create_dir_all(to_dir).unwrap();
    for n in names {
        std::fs::copy(from.join(n), to_dir.join(n)).unwrap();
    }
}

/// A virtual environment with CUDA 13's and/or CUDA 12's wheels; returns the venv.
fn venv(root: &Path, case: &str, with13: bool, with12: bool) -> PathBuf {
    let site = root.join(case).join("venv/lib/python3.12/site-packages");
    if with13 {
        copy(
            &root.join("13.0"),
            &site.join("nvidia/cu13/lib"),
            &[
                "libnvrtc.so.13",
                "libnvrtc-builtins.so.13.0",
                "libcublas.so.13",
                "libcublasLt.so.13",
            ],
        );
    }
    if with12 {
        copy(
            &root.join("12.9"),
            &site.join("nvidia/cuda_nvrtc/lib"),
            &["libnvrtc.so.12", "libnvrtc-builtins.so.12.9"],
        );
        copy(
            &root.join("12.9"),
            &site.join("nvidia/cublas/lib"),
            &["libcublas.so.12", "libcublasLt.so.12"],
        );
    }
    std::fs::create_dir_all(&site).unwrap();
    root.join(case).join("venv")
}

/// A CUDA 12.4 toolkit's lib64: real files with full versions, soname and dev links.
fn toolkit_12_4(root: &Path, case: &str) -> PathBuf {
    let lib = root.join(case).join("cuda-12.4/lib64");
    std::fs::create_dir_all(&lib).unwrap();
    let v = root.join("12.4");
    for (file, full, links) in [
        (
            "libnvrtc.so.12",
            "libnvrtc.so.12.4.127",
            &["libnvrtc.so.12", "libnvrtc.so"][..],
        ),
        (
            "libnvrtc-builtins.so.12.4",
            "libnvrtc-builtins.so.12.4.127",
            &["libnvrtc-builtins.so.12.4", "libnvrtc-builtins.so"][..],
        ),
        (
            "libcublas.so.12",
            "libcublas.so.12.4.5.8",
            &["libcublas.so.12", "libcublas.so"][..],
        ),
        (
            "libcublasLt.so.12",
            "libcublasLt.so.12.4.5.8",
            &["libcublasLt.so.12", "libcublasLt.so"][..],
        ),
    ] {
        std::fs::copy(v.join(file), lib.join(full)).unwrap();
        for l in links {
            std::os::unix::fs::symlink(full, lib.join(l)).unwrap();
        }
    }
    root.join(case).join("cuda-12.4")
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `name` again in a child process with `env` (and the stand-ins' root `root`), with
/// nothing of this machine's Python or CUDA settings in its environment.
fn in_child(root: &Path, name: &str, env: &[(&str, &Path)]) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(ROOT, root)
        .env("HOME", root.join("home"))
        .env("PATH", "/usr/bin:/bin")
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX")
        .env_remove("PYTHONPATH")
        .env_remove("PYTHONUSERBASE")
        .env_remove("NPU_SERVING_CUDA_LIB_DIR")
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env_remove("CUDA_ROOT")
        .envs(env.iter().map(|(k, v)| (*k, v.as_os_str())))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{name} failed in its process:\n{text}"
    );
    assert!(text.contains("1 passed"), "{name} did not run:\n{text}");
}

fn root() -> PathBuf {
    PathBuf::from(std::env::var_os(ROOT).expect("the stand-ins' root"))
}

/// The fallback directories only (the test machine's own loader path may hold a real CUDA).
fn fallback_only() -> Search {
    Search::only(libs::default_search_dirs())
}

// Each case: the parent lays out the files (in `setup_*`) and the child loads them.

#[test]
fn cuda_13_wheels_are_found_before_cuda_12_ones() {
    if !is_child() {
        let Some(r) = standins() else { return };
        let v = venv(r, "both", true, true);
        in_child(
            r,
            "cuda_13_wheels_are_found_before_cuda_12_ones",
            &[("VIRTUAL_ENV", &v)],
        );
        return;
    }
    let site = root().join("both/venv/lib/python3.12/site-packages");
    let dirs = libs::default_search_dirs();
    let at = |p: &str| dirs.iter().position(|d| d == &site.join(p));
    let (cu13, nvrtc12, cublas12) = (
        at("nvidia/cu13/lib").expect("the cu13 wheel dir is searched"),
        at("nvidia/cuda_nvrtc/lib").expect("the cu12 NVRTC wheel dir is searched"),
        at("nvidia/cublas/lib").expect("the cu12 cuBLAS wheel dir is searched"),
    );
    assert!(cu13 < nvrtc12 && cu13 < cublas12, "{dirs:?}");
    // A CUDA 13 driver: CUDA 13's libraries.
    let n = NvrtcApi::load(&fallback_only(), Some(13)).unwrap();
    assert_eq!(n.version, (13, 0), "{n:?}");
    assert!(n.origin().contains("nvidia/cu13/lib"), "{n:?}");
    assert_eq!(
        n.companions(),
        &[site.join("nvidia/cu13/lib/libnvrtc-builtins.so.13.0")]
    );
    n.compile_source("x", Target::Cubin(9, 0)).unwrap();
    let b = CublasApi::load(&fallback_only(), Some(13)).unwrap();
    assert_eq!((b.version.0, b.version.1), (13, 0), "{b:?}");
    assert!(b.origin().contains("nvidia/cu13/lib"), "{b:?}");
    b.create().unwrap();
}

#[test]
fn a_cuda_12_driver_gets_the_cuda_12_wheels() {
    if !is_child() {
        let Some(r) = standins() else { return };
        let v = venv(r, "driver12", true, true);
        in_child(
            r,
            "a_cuda_12_driver_gets_the_cuda_12_wheels",
            &[("VIRTUAL_ENV", &v)],
        );
        return;
    }
    let n = NvrtcApi::load(&fallback_only(), Some(12)).unwrap();
    assert_eq!(n.version, (12, 9), "{n:?}");
    assert!(n.origin().contains("nvidia/cuda_nvrtc/lib"), "{n:?}");
    n.compile_source("x", Target::Ptx(9, 0)).unwrap();
    let b = CublasApi::load(&fallback_only(), Some(12)).unwrap();
    assert_eq!((b.version.0, b.version.1), (12, 9), "{b:?}");
    assert!(b.origin().contains("nvidia/cublas/lib"), "{b:?}");
}

#[test]
fn cuda_13_alone_with_a_cuda_12_driver_says_what_to_install() {
    if !is_child() {
        let Some(r) = standins() else { return };
        let v = venv(r, "only13", true, false);
        in_child(
            r,
            "cuda_13_alone_with_a_cuda_12_driver_says_what_to_install",
            &[("VIRTUAL_ENV", &v)],
        );
        return;
    }
    let e = NvrtcApi::load(&fallback_only(), Some(12)).unwrap_err();
    for want in [
        "libnvrtc.so.13 in",
        "(CUDA 13)",
        "supports CUDA 12 at most",
        "pip install nvidia-cuda-nvrtc-cu12",
    ] {
        assert!(e.contains(want), "{want:?} not in: {e}");
    }
    let e = CublasApi::load(&fallback_only(), Some(12)).unwrap_err();
    assert!(e.contains("pip install nvidia-cublas-cu12"), "{e}");
    // With a CUDA 13 driver the same install is fine.
    assert_eq!(
        NvrtcApi::load(&fallback_only(), Some(13)).unwrap().version,
        (13, 0)
    );
}

#[test]
fn a_toolkit_off_the_loader_path_compiles_with_its_builtins() {
    if !is_child() {
        let Some(r) = standins() else { return };
        let tk = toolkit_12_4(r, "toolkit");
        in_child(
            r,
            "a_toolkit_off_the_loader_path_compiles_with_its_builtins",
            &[("CUDA_HOME", &tk)],
        );
        return;
    }
    let lib64 = root().join("toolkit/cuda-12.4/lib64");
    assert!(libs::default_search_dirs().contains(&lib64));
    // The failure the review describes (finding 2): NVRTC loaded by its path alone cannot find
    // its builtins at the first compile.
    // SAFETY: a stand-in library built by this test.
    unsafe {
        let l = libloading::Library::new(lib64.join("libnvrtc.so.12")).unwrap();
        let compile: libloading::Symbol<unsafe extern "C" fn(*mut u8, i32, *const u8) -> i32> =
            l.get(b"nvrtcCompileProgram").unwrap();
        assert_eq!(compile(std::ptr::null_mut(), 0, std::ptr::null()), 7);
    }
    // Found through CUDA_HOME, with the builtins loaded first: the compile works.
    let n = NvrtcApi::load(&fallback_only(), Some(13)).unwrap();
    assert_eq!(n.version, (12, 4), "{n:?}");
    assert_eq!(
        n.companions(),
        &[lib64.join("libnvrtc-builtins.so.12.4.127")]
    );
    n.compile_source("x", Target::Cubin(8, 6)).unwrap();
}

#[test]
fn cublas_off_the_loader_path_loads_cublaslt_first() {
    if !is_child() {
        let Some(r) = standins() else { return };
        let tk = toolkit_12_4(r, "cublas");
        let lib64 = tk.join("lib64");
        in_child(
            r,
            "cublas_off_the_loader_path_loads_cublaslt_first",
            &[("NPU_SERVING_CUDA_LIB_DIR", &lib64)],
        );
        return;
    }
    let lib64 = root().join("cublas/cuda-12.4/lib64");
    assert_eq!(libs::default_search_dirs().first(), Some(&lib64));
    // By its path alone, libcublas cannot resolve its dependency.
    // SAFETY: a stand-in library built by this test.
    let alone = unsafe { libloading::Library::new(lib64.join("libcublas.so.12")) };
    let e = libs::dl_error(&alone.expect_err("libcublas.so.12 alone must not load"));
    assert!(e.contains("libcublasLt.so.12"), "{e}");
    let b = CublasApi::load(&fallback_only(), None).unwrap();
    assert_eq!((b.version.0, b.version.1), (12, 4), "{b:?}");
    b.create().unwrap();
}

#[test]
fn nothing_found_names_both_versions_and_their_wheels() {
    let e = NvrtcApi::load(&Search::only(Vec::new()), None).unwrap_err();
    assert!(e.contains("libnvrtc.so.13 then libnvrtc.so.12"), "{e}");
    for lib in [CudaLib::Nvrtc, CudaLib::Cublas] {
        let h = lib.how_to_get();
        for p in [lib.pip_package(13).unwrap(), lib.pip_package(12).unwrap()] {
            assert!(h.contains(p), "{h}");
        }
    }
}
