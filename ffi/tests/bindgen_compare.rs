//! Compares the hand-written declarations of `src/` with bindgen's rendering of CANN's own
//! headers, whenever `build.rs` found them (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME at build
//! time). Without headers the test prints why it was skipped and passes.

use npu_ffi::acl_rt::AclRuntimeApi;
use npu_ffi::aclnn::base::AclnnBaseApi;
use npu_ffi::aclnn::ops::AclnnOpsApi;
use npu_ffi::table::Declaration;
use npu_ffi::types as t;

const BINDINGS: &str = include_str!(concat!(env!("OUT_DIR"), "/cann_bindings.rs"));
const STATUS: &str = include_str!(concat!(env!("OUT_DIR"), "/cann_bindings_status.txt"));

/// Whitespace and path prefixes removed, so both renderings read alike.
fn normalize(s: &str) -> String {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    s.replace("::std::os::raw::", "")
        .replace("::core::ffi::", "")
        .replace("::std::ffi::", "")
        .replace("core::ffi::", "")
}

/// Splits `a:T,b:U` at top-level commas.
fn split_params(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut cur) = (0i32, String::new());
    for c in s.chars() {
        match c {
            '(' | '<' | '[' => depth += 1,
            ')' | '>' | ']' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// bindgen's prototype of `name`: (parameter types, return type).
fn bindgen_fn(norm: &str, name: &str) -> Option<(Vec<String>, String)> {
    let key = format!("pubfn{name}(");
    let start = norm.find(&key)? + key.len();
    let rest = &norm[start..];
    let mut depth = 1;
    let mut end = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let params = split_params(&rest[..end])
        .into_iter()
        .map(|p| p.split_once(':').map(|(_, ty)| ty.to_string()).unwrap_or(p))
        .collect();
    let after = &rest[end + 1..];
    let semi = after.find(';')?;
    let ret = after[..semi].strip_prefix("->").unwrap_or("()").to_string();
    Some((params, ret))
}

fn bindgen_const(norm: &str, name: &str) -> Option<i64> {
    let key = format!("pubconst{name}:");
    let start = norm.find(&key)? + key.len();
    let rest = &norm[start..];
    let eq = rest.find('=')?;
    let semi = rest.find(';')?;
    rest[eq + 1..semi].parse().ok()
}

#[test]
fn hand_written_declarations_match_cann_headers() {
    if BINDINGS.trim().is_empty() {
        println!("bindgen comparison {STATUS}");
        return;
    }
    println!("bindgen comparison: {STATUS}");
    let norm = normalize(BINDINGS);
    let all: Vec<&Declaration> = AclRuntimeApi::DECLARATIONS
        .iter()
        .chain(AclnnBaseApi::DECLARATIONS)
        .chain(AclnnOpsApi::DECLARATIONS)
        .collect();
    let mut mismatches = Vec::new();
    let (mut compared, mut absent) = (0, Vec::new());
    for d in all {
        let Some((params, ret)) = bindgen_fn(&norm, d.name) else {
            // Optional symbols belong to newer releases; required ones must be in the headers.
            if d.required {
                mismatches.push(format!(
                    "{}: declared as required but absent from the headers",
                    d.name
                ));
            } else {
                absent.push(d.name);
            }
            continue;
        };
        compared += 1;
        let ours: Vec<String> = d.params.iter().map(|(_, ty)| normalize(ty)).collect();
        if ours != params {
            mismatches.push(format!(
                "{}: parameters\n  ours:    {ours:?}\n  headers: {params:?}",
                d.name
            ));
        }
        if normalize(d.ret) != ret {
            mismatches.push(format!("{}: returns ours {} headers {ret}", d.name, d.ret));
        }
    }
    let consts: &[(&str, i64)] = &[
        ("aclDataType_ACL_FLOAT", t::ACL_FLOAT as i64),
        ("aclDataType_ACL_FLOAT16", t::ACL_FLOAT16 as i64),
        ("aclDataType_ACL_INT8", t::ACL_INT8 as i64),
        ("aclDataType_ACL_INT32", t::ACL_INT32 as i64),
        ("aclDataType_ACL_UINT8", t::ACL_UINT8 as i64),
        ("aclDataType_ACL_INT64", t::ACL_INT64 as i64),
        ("aclDataType_ACL_BOOL", t::ACL_BOOL as i64),
        ("aclDataType_ACL_BF16", t::ACL_BF16 as i64),
        ("aclDataType_ACL_INT4", t::ACL_INT4 as i64),
        ("aclFormat_ACL_FORMAT_ND", t::ACL_FORMAT_ND as i64),
        (
            "aclFormat_ACL_FORMAT_FRACTAL_NZ",
            t::ACL_FORMAT_FRACTAL_NZ as i64,
        ),
        (
            "aclrtMemcpyKind_ACL_MEMCPY_HOST_TO_DEVICE",
            t::ACL_MEMCPY_HOST_TO_DEVICE as i64,
        ),
        (
            "aclrtMemcpyKind_ACL_MEMCPY_DEVICE_TO_HOST",
            t::ACL_MEMCPY_DEVICE_TO_HOST as i64,
        ),
        (
            "aclrtMemcpyKind_ACL_MEMCPY_DEVICE_TO_DEVICE",
            t::ACL_MEMCPY_DEVICE_TO_DEVICE as i64,
        ),
        (
            "aclrtMemMallocPolicy_ACL_MEM_MALLOC_HUGE_FIRST",
            t::ACL_MEM_MALLOC_HUGE_FIRST as i64,
        ),
        ("aclrtMemAttr_ACL_HBM_MEM", t::ACL_HBM_MEM as i64),
        ("ACL_ERROR_INVALID_PARAM", t::ACL_ERROR_INVALID_PARAM as i64),
        ("ACL_ERROR_BAD_ALLOC", t::ACL_ERROR_BAD_ALLOC as i64),
        (
            "ACL_ERROR_RT_ADDR_UNALIGNED",
            t::ACL_ERROR_RT_ADDR_UNALIGNED as i64,
        ),
        (
            "ACL_ERROR_RT_INVALID_MEMORY_TYPE",
            t::ACL_ERROR_RT_INVALID_MEMORY_TYPE as i64,
        ),
        (
            "ACL_ERROR_RT_PARAM_INVALID",
            t::ACL_ERROR_RT_PARAM_INVALID as i64,
        ),
    ];
    for (name, ours) in consts {
        match bindgen_const(&norm, name) {
            Some(v) if v == *ours => {}
            Some(v) => mismatches.push(format!("{name}: ours {ours} headers {v}")),
            None => mismatches.push(format!("{name}: absent from the headers")),
        }
    }
    println!("compared {compared} prototypes; optional ones absent from these headers: {absent:?}");
    assert!(
        mismatches.is_empty(),
        "declarations differ from CANN's headers:\n{}",
        mismatches.join("\n")
    );
}
