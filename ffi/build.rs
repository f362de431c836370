//! When CANN's headers are installed (found through `ASCEND_HOME_PATH` / `ASCEND_TOOLKIT_HOME`,
//! in the CANN ≤ 8.3 `ascend-toolkit/latest` layout or the 8.5+ `cann` layout), regenerates the
//! declarations of `src/` with bindgen into `$OUT_DIR/cann_bindings.rs`; the test
//! `tests/bindgen_compare.rs` compares them with the hand-written ones. Without headers (or
//! without libclang, which bindgen's `runtime` feature loads only here) it writes an empty file
//! and the reason, and the build goes on: nothing links CANN at build time.

use std::path::{Path, PathBuf};

/// The aclnn operator headers whose functions are declared in `src/aclnn.rs`.
const OP_HEADERS: &[&str] = &[
    "aclnn_add.h",
    "aclnn_cast.h",
    "aclnn_copy.h",
    "aclnn_nan_to_num.h",
    "aclnn_log_softmax.h",
    "aclnn_gather.h",
    "aclnn_mul.h",
    "aclnn_dynamic_quant.h",
    "aclnn_rms_norm.h",
    "aclnn_swi_glu.h",
    "aclnn_embedding.h",
    "aclnn_argmax.h",
    "aclnn_matmul.h",
    "aclnn_weight_quant_batch_matmul_v2.h",
    "aclnn_fused_infer_attention_score_v2.h",
    "aclnn_incre_flash_attention_v4.h",
    "aclnn_scatter_nd_update.h",
    "aclnn_apply_rotary_pos_emb.h",
    "aclnn_rotary_position_embedding.h",
    "aclnn_scatter_pa_kv_cache.h",
    "aclnn_gelu_v2.h",
];

fn roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let r = PathBuf::from(v);
            roots.push(r.clone());
            roots.push(r.join("ascend-toolkit/latest"));
            roots.push(r.join("latest"));
            roots.push(r.join("cann"));
        }
    }
    roots
}

fn include_dirs(roots: &[PathBuf]) -> Vec<PathBuf> {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    let mut dirs = Vec::new();
    for r in roots {
        for sub in [
            "include".to_string(),
            format!("{arch}-linux/include"),
            "opp/built-in/op_impl/ai_core/tbe/op_api/include".to_string(),
        ] {
            let d = r.join(sub);
            if d.is_dir() && !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    dirs
}

fn find(dirs: &[PathBuf], rel: &str) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(rel)).find(|p| p.is_file())
}

fn generate(dirs: &[PathBuf], out: &Path) -> Result<String, String> {
    find(dirs, "acl/acl.h").ok_or("acl/acl.h not found")?;
    find(dirs, "aclnn/acl_meta.h").ok_or("aclnn/acl_meta.h not found")?;
    let mut wrapper = String::from("#include \"acl/acl.h\"\n#include \"aclnn/acl_meta.h\"\n");
    let mut found = Vec::new();
    for h in OP_HEADERS {
        let rel = [format!("aclnnop/{h}"), format!("aclnnop/level2/{h}")]
            .into_iter()
            .find(|rel| find(dirs, rel).is_some());
        if let Some(rel) = rel {
            wrapper.push_str(&format!("#include \"{rel}\"\n"));
            found.push(*h);
        }
    }
    let wrapper_path = out.join("cann_wrapper.hpp");
    std::fs::write(&wrapper_path, wrapper).map_err(|e| e.to_string())?;
    let mut builder = bindgen::Builder::default()
        .header(wrapper_path.display().to_string())
        .clang_arg("-xc++")
        .clang_arg("-std=c++14")
        .allowlist_function("acl.*")
        .allowlist_type("acl.*")
        .allowlist_var("ACL.*")
        .formatter(bindgen::Formatter::None)
        .layout_tests(false);
    for d in dirs {
        builder = builder.clang_arg(format!("-I{}", d.display()));
    }
    // bindgen's `runtime` feature loads libclang now; a missing libclang panics inside bindgen.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
    let bindings = match result {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Err(format!("bindgen failed: {e}")),
        Err(_) => return Err("bindgen could not run (is libclang installed?)".into()),
    };
    bindings
        .write_to_file(out.join("cann_bindings.rs"))
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "generated from {} (op headers found: {})",
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        found.join(", ")
    ))
}

fn main() {
    println!("cargo:rerun-if-env-changed=ASCEND_HOME_PATH");
    println!("cargo:rerun-if-env-changed=ASCEND_TOOLKIT_HOME");
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let bindings = out.join("cann_bindings.rs");
    let _ = std::fs::write(&bindings, "");
    let dirs = include_dirs(&roots());
    let status = if dirs.is_empty() {
        "skipped: no CANN headers (set ASCEND_HOME_PATH or ASCEND_TOOLKIT_HOME to a CANN install with include/acl/acl.h)".to_string()
    } else {
        match generate(&dirs, &out) {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::write(&bindings, "");
                println!("cargo:warning=CANN headers found but bindings not generated: {e}");
                format!("skipped: {e}")
            }
        }
    };
    std::fs::write(out.join("cann_bindings_status.txt"), status).expect("write status");
}
