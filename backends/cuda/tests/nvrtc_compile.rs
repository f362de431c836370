//! Compiles every kernel with each NVRTC this machine has (CUDA 13's and CUDA 12's, found as the
//! backend finds them: the loader's path, NPU_SERVING_CUDA_LIB_DIR, the pip wheels
//! `nvidia-cuda-nvrtc` (13, `nvidia/cu13/lib`) and `nvidia-cuda-nvrtc-cu12`
//! (`nvidia/cuda_nvrtc/lib`), the toolkits): a CUBIN for sm_80, sm_86, sm_89 and sm_90 (the
//! device's own architecture is what the backend compiles for) and PTX for compute_80 and
//! compute_90 with every entry point. NVRTC needs no GPU and no driver; scripts/test.sh installs
//! the CUDA 12 wheel. Without any NVRTC the test says why it skipped.
//!
//! Also checks what the program asks of NVRTC: no header (nothing to find or embed), and no
//! product and sum contracted into one FMA (review finding 7: `--fmad=false`, so the GPU rounds
//! as the CPU reference and the emulation do).

use std::path::PathBuf;
use std::time::Instant;

use npu_backend_cuda::kernels::{kernel_names, program_source};
use npu_backend_cuda::libs::{self, CudaLib, Search};
use npu_backend_cuda::nvrtc::{options, NvrtcApi, Target};

/// One NVRTC per CUDA major: (major, where).
fn installs() -> Vec<(u32, Option<PathBuf>)> {
    let search = Search::with_dirs(libs::default_search_dirs());
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for (major, dir) in libs::find_all(CudaLib::Nvrtc, &search) {
        if !seen.contains(&major) {
            seen.push(major);
            out.push((major, dir));
        }
    }
    out
}

fn load(major: u32, dir: &Option<PathBuf>) -> NvrtcApi {
    let search = match dir {
        Some(d) => Search::only(vec![d.clone()]),
        None => Search::with_dirs(Vec::new()),
    };
    NvrtcApi::load(&search, Some(major)).unwrap_or_else(|e| panic!("{e}"))
}

/// Lines of PTX that multiply, add or subtract f32 values without a rounding mode: those ptxas
/// may fuse into an FMA.
fn contractible(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter(|l| {
            let t = l.trim_start();
            ["mul.f32", "add.f32", "sub.f32"]
                .iter()
                .any(|op| t.starts_with(op))
        })
        .map(|l| l.trim().to_string())
        .collect()
}

#[test]
fn every_kernel_compiles_for_sm80_to_sm90_with_each_nvrtc() {
    let found = installs();
    if found.is_empty() {
        eprintln!(
            "SKIPPED every_kernel_compiles_for_sm80_to_sm90_with_each_nvrtc: no NVRTC found ({})",
            CudaLib::Nvrtc.how_to_get()
        );
        return;
    }
    let src = program_source();
    assert!(
        !src.contains("#include"),
        "the kernel program includes a header: NVRTC would need an include path"
    );
    let names = kernel_names();
    for (major, dir) in &found {
        let api = load(*major, dir);
        eprintln!(
            "NVRTC {}.{} from {} (also loaded: {:?})",
            api.version.0,
            api.version.1,
            api.origin(),
            api.companions()
        );
        let archs = api.supported_archs().unwrap();
        // The six compilations are independent programs, run on threads at once: NVRTC's API
        // may be called from several threads concurrently (its guide, "Thread Safety"), and
        // the test's time is most of a minute each.
        std::thread::scope(|s| {
            for t in [
                Target::Cubin(8, 0),
                Target::Cubin(8, 6),
                Target::Cubin(8, 9),
                Target::Cubin(9, 0),
            ] {
                let (api, src, archs) = (&api, &src, &archs);
                s.spawn(move || {
                    let Target::Cubin(a, b) = t else {
                        unreachable!()
                    };
                    assert!(
                        archs.contains(&(a * 10 + b)),
                        "NVRTC {}.{} lacks sm_{a}{b}",
                        api.version.0,
                        api.version.1
                    );
                    let t0 = Instant::now();
                    let cubin = api.compile_source(src, t).unwrap_or_else(|e| panic!("{e}"));
                    assert!(cubin.starts_with(b"\x7fELF"), "sm_{a}{b}: not an ELF image");
                    eprintln!(
                        "  sm_{a}{b}: CUBIN of {} KiB in {:.1} s",
                        cubin.len() >> 10,
                        t0.elapsed().as_secs_f64()
                    );
                });
            }
            for (a, b) in [(8, 0), (9, 0)] {
                let (api, src, names) = (&api, &src, &names);
                s.spawn(move || {
                    let ptx = api
                        .compile_source(src, Target::Ptx(a, b))
                        .unwrap_or_else(|e| panic!("{e}"));
                    let text = String::from_utf8_lossy(&ptx);
                    for n in names {
                        assert!(
                            text.contains(&format!(".entry {n}(")),
                            "compute_{a}{b}: no entry point {n}"
                        );
                    }
                    let loose = contractible(&text);
                    assert!(
                        loose.is_empty(),
                        "compute_{a}{b}: f32 arithmetic ptxas may contract: {:?}",
                        &loose[..loose.len().min(5)]
                    );
                });
            }
        });
        // The options themselves keep a*b + c apart (and an explicit fmaf fused).
        let probe = "extern \"C\" __global__ void probe(float* o, const float* a) {\n\
                     o[0] = a[0] * a[1] + a[2];\n o[1] = fmaf(a[0], a[1], a[2]);\n}\n";
        let ptx = api.compile_source(probe, Target::Ptx(8, 0)).unwrap();
        let text = String::from_utf8_lossy(&ptx);
        assert_eq!(
            text.matches("fma.rn.f32").count(),
            1,
            "options {:?}: {text}",
            options(Target::Ptx(8, 0))
        );
        assert!(
            text.contains("mul.rn.f32") && text.contains("add.rn.f32"),
            "{text}"
        );
    }
}
