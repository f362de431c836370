//! `npu_serving.kv_cache_dtype`: auto (the default, f16 today), f16 or int8; int8 on the CPU
//! and CUDA backends only; anything else refused naming the key.

use npu_server::config::{KvCacheDtype, ServerConfig};

fn parse(yaml: &str) -> Result<ServerConfig, String> {
    ServerConfig::from_yaml_str(yaml).map_err(|e| e.to_string())
}

#[test]
fn kv_cache_dtype_defaults_to_auto_and_takes_f16_and_int8() {
    assert_eq!(
        parse("").unwrap().npu_serving.kv_cache_dtype,
        KvCacheDtype::Auto
    );
    for (v, want) in [
        ("auto", KvCacheDtype::Auto),
        ("f16", KvCacheDtype::F16),
        ("INT8", KvCacheDtype::Int8),
    ] {
        let cfg = parse(&format!("npu_serving:\n  kv_cache_dtype: {v}\n")).unwrap();
        assert_eq!(cfg.npu_serving.kv_cache_dtype, want, "{v}");
    }
}

#[test]
fn a_bad_kv_cache_dtype_is_refused_naming_the_key() {
    for v in ["fp8", "int4", "1"] {
        let e = parse(&format!("npu_serving:\n  kv_cache_dtype: {v}\n")).unwrap_err();
        assert!(e.contains("npu_serving.kv_cache_dtype"), "{e}");
    }
    let e = parse("npu_serving:\n  device: ascend\n  kv_cache_dtype: int8\n").unwrap_err();
    assert!(
        e.contains("npu_serving.kv_cache_dtype")
            && e.contains("CPU and CUDA backends only")
            && e.contains("FusedInferAttentionScore")
            && e.contains("only when Q_S = 1"),
        "{e}"
    );
    let cfg = parse("npu_serving:\n  device: cuda\n  kv_cache_dtype: f16\n").unwrap();
    assert_eq!(cfg.npu_serving.kv_cache_dtype, KvCacheDtype::F16);
    let cfg = parse("npu_serving:\n  device: cuda\n  kv_cache_dtype: int8\n").unwrap();
    assert_eq!(cfg.npu_serving.kv_cache_dtype, KvCacheDtype::Int8);
}
