//! The ACL runtime entry points (`libascendcl.so`): init/finalize, devices, contexts, streams,
//! events, device and pinned host memory, copies, memory info, version and error message.
//!
//! Strictness (from the AscendCL reference): nothing works before `aclInit` or after
//! `aclFinalize`, and `aclInit` is once per process (ACL_ERROR_REPEAT_INITIALIZE); memory and
//! stream calls need a current context on the calling thread (ACL_ERROR_RT_CONTEXT_NULL);
//! `aclrtMemcpyAsync` needs 64-byte aligned source and destination (ACL_ERROR_RT_ADDR_UNALIGNED),
//! refuses host-to-host (ACL_ERROR_RT_FEATURE_NOT_SUPPORT) and host memory not from
//! `aclrtMallocHost`; every copy's device side must be device memory and its host side must not be
//! (ACL_ERROR_RT_INVALID_MEMORY_TYPE); `count` may not exceed `destMax`.

use core::ffi::{c_char, c_void};

use npu_ffi::types::*;

use crate::state::*;

fn run(f: impl FnOnce(&mut State) -> Result<(), Fail>) -> aclError {
    let mut st = state();
    finish(f(&mut st))
}

extern "C" fn report_at_exit() {
    // try_lock: a thread stopped inside a call must not hang the exit.
    match try_state() {
        Some(st) if st.initialized && !st.finalized => print_report(&st, "process exit"),
        Some(_) => {}
        None => eprintln!("ascend-emulator: state busy at process exit; no leak report"),
    }
}

fn print_report(st: &State, when: &str) {
    let leaks = st.leak_report();
    if leaks.is_empty() {
        // A positive line, so a test can tell a clean finalize from one that never ran.
        eprintln!("ascend-emulator: nothing left alive at {when}");
    } else {
        eprintln!(
            "ascend-emulator: {} object(s) never destroyed at {when}:",
            leaks.len()
        );
        for l in leaks {
            eprintln!("ascend-emulator:   {l}");
        }
    }
}

#[no_mangle]
pub extern "C" fn aclInit(_configPath: *const c_char) -> aclError {
    run(|st| {
        if st.initialized {
            return fail(
                ACL_ERROR_REPEAT_INITIALIZE,
                "aclInit called twice in this process",
            );
        }
        st.initialized = true;
        // SAFETY: registering a plain extern "C" function with no arguments.
        unsafe { libc::atexit(report_at_exit) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclFinalize() -> aclError {
    finish((|| {
        let ids = {
            let st = state();
            if st.finalized {
                return fail(ACL_ERROR_REPEAT_FINALIZE, "aclFinalize called twice");
            }
            st.require_init()?;
            st.streams.keys().copied().collect::<Vec<_>>()
        };
        synchronize_streams(&ids)?;
        let mut st = state();
        print_report(&st, "aclFinalize");
        st.finalized = true;
        Ok(())
    })())
}

#[no_mangle]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    last_error_ptr()
}

fn check_device(id: i32) -> Result<(), Fail> {
    if id < 0 || id as u32 >= device_count() {
        return fail(
            ACL_ERROR_RT_INVALID_DEVICEID,
            format!("device {id} does not exist ({} visible)", device_count()),
        );
    }
    Ok(())
}

fn new_context(st: &mut State, device: i32) -> u64 {
    let c = st.new_handle(KIND_CONTEXT);
    let s = st.new_handle(KIND_STREAM);
    st.streams.insert(
        s,
        Stream {
            context: c,
            device,
            queue: Default::default(),
        },
    );
    st.contexts.insert(
        c,
        Context {
            device,
            default_stream: s,
        },
    );
    c
}

#[no_mangle]
pub extern "C" fn aclrtSetDevice(deviceId: i32) -> aclError {
    run(|st| {
        st.require_init()?;
        check_device(deviceId)?;
        // aclrtSetDevice is reference-counted per device; aclrtResetDevice releases one count.
        let c = match st.devices_set.get(&deviceId) {
            Some(&c) => c,
            None => {
                let c = new_context(st, deviceId);
                st.devices_set.insert(deviceId, c);
                c
            }
        };
        *st.device_refs.entry(deviceId).or_insert(0) += 1;
        CURRENT_CONTEXT.with(|cur| cur.set(c));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtResetDevice(deviceId: i32) -> aclError {
    run(|st| {
        st.require_init()?;
        let Some(&c) = st.devices_set.get(&deviceId) else {
            return fail(
                ACL_ERROR_RT_INVALID_DEVICEID,
                format!("aclrtResetDevice({deviceId}) without aclrtSetDevice"),
            );
        };
        let refs = st.device_refs.entry(deviceId).or_insert(1);
        *refs -= 1;
        if *refs > 0 {
            return Ok(());
        }
        st.device_refs.remove(&deviceId);
        st.devices_set.remove(&deviceId);
        let ds = st.contexts[&c].default_stream;
        st.run_stream(ds)?;
        st.streams.remove(&ds);
        st.contexts.remove(&c);
        CURRENT_CONTEXT.with(|cur| {
            if cur.get() == c {
                cur.set(0)
            }
        });
        Ok(())
    })
}

/// # Safety
/// `deviceId` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDevice(deviceId: *mut i32) -> aclError {
    run(|st| {
        let d = st.current_context()?.1.device;
        if deviceId.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice: null out-pointer");
        }
        // SAFETY: checked non-null.
        unsafe { *deviceId = d };
        Ok(())
    })
}

/// The emulated SoC's name: `ASCEND_EMULATOR_SOC` (to emulate another chip's limits, e.g.
/// "Ascend910_9391", an Atlas A3), else "Ascend910B3" (an Atlas A2).
pub fn soc_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        std::env::var("ASCEND_EMULATOR_SOC")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| "Ascend910B3".into())
    })
}

/// `aclrtGetSocName`: the emulated SoC's name ([`soc_name`]), NUL-terminated, alive for the
/// process.
#[no_mangle]
pub extern "C" fn aclrtGetSocName() -> *const c_char {
    static NAME: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        std::ffi::CString::new(soc_name()).unwrap_or_else(|_| c"Ascend910B3".to_owned())
    })
    .as_ptr()
}

/// # Safety
/// `count` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> aclError {
    run(|st| {
        st.require_init()?;
        if count.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtGetDeviceCount: null out-pointer",
            );
        }
        // SAFETY: checked non-null.
        unsafe { *count = device_count() };
        Ok(())
    })
}

/// # Safety
/// `context` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateContext(context: *mut aclrtContext, deviceId: i32) -> aclError {
    run(|st| {
        st.require_init()?;
        check_device(deviceId)?;
        if context.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtCreateContext: null out-pointer",
            );
        }
        let c = new_context(st, deviceId);
        CURRENT_CONTEXT.with(|cur| cur.set(c));
        // SAFETY: checked non-null.
        unsafe { *context = c as aclrtContext };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtDestroyContext(context: aclrtContext) -> aclError {
    run(|st| {
        st.require_init()?;
        let c = context as u64;
        if !st.contexts.contains_key(&c) || st.devices_set.values().any(|&d| d == c) {
            return fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("{c:#x} is not a context made by aclrtCreateContext"),
            );
        }
        if st
            .streams
            .iter()
            .any(|(s, x)| x.context == c && *s != st.contexts[&c].default_stream)
        {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                "aclrtDestroyContext: destroy its streams first",
            );
        }
        let ds = st.contexts[&c].default_stream;
        st.run_stream(ds)?;
        st.streams.remove(&ds);
        st.contexts.remove(&c);
        CURRENT_CONTEXT.with(|cur| {
            if cur.get() == c {
                cur.set(0)
            }
        });
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtSetCurrentContext(context: aclrtContext) -> aclError {
    run(|st| {
        st.require_init()?;
        if !st.contexts.contains_key(&(context as u64)) {
            return fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("{:#x} is not a live context", context as u64),
            );
        }
        CURRENT_CONTEXT.with(|cur| cur.set(context as u64));
        Ok(())
    })
}

/// # Safety
/// `context` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetCurrentContext(context: *mut aclrtContext) -> aclError {
    run(|st| {
        let (c, _) = st.current_context()?;
        if context.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtGetCurrentContext: null out-pointer",
            );
        }
        // SAFETY: checked non-null.
        unsafe { *context = c as aclrtContext };
        Ok(())
    })
}

/// # Safety
/// `stream` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError {
    run(|st| {
        st.require_init()?;
        let (c, ctx) = st.current_context()?;
        let device = ctx.device;
        if stream.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtCreateStream: null out-pointer",
            );
        }
        let s = st.new_handle(KIND_STREAM);
        st.streams.insert(
            s,
            Stream {
                context: c,
                device,
                queue: Default::default(),
            },
        );
        // SAFETY: checked non-null.
        unsafe { *stream = s as aclrtStream };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtDestroyStream(stream: aclrtStream) -> aclError {
    run(|st| {
        st.require_init()?;
        let s = stream as u64;
        if s == 0
            || !st.streams.contains_key(&s)
            || st.contexts.values().any(|c| c.default_stream == s)
        {
            return fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("{s:#x} is not a stream made by aclrtCreateStream"),
            );
        }
        st.check_not_capturing(s, "aclrtDestroyStream")?;
        if !st.streams[&s].queue.is_empty() || st.busy.contains_key(&s) {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                "aclrtDestroyStream: the stream still has queued work; synchronize it first",
            );
        }
        st.stream_errors.remove(&s);
        st.streams.remove(&s);
        Ok(())
    })
}

/// `f`'s result under the lock, then the lock released (for a synchronization to follow).
fn locked<T>(f: impl FnOnce(&mut State) -> Result<T, Fail>) -> Result<T, Fail> {
    let mut st = state();
    f(&mut st)
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError {
    finish(
        locked(|st| {
            st.require_init()?;
            let s = st.resolve_stream(stream as u64)?;
            st.check_not_capturing(s, "aclrtSynchronizeStream")?;
            Ok(s)
        })
        .and_then(|s| synchronize_streams(&[s])),
    )
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeDevice() -> aclError {
    finish(
        locked(|st| {
            st.require_init()?;
            let device = st.current_context()?.1.device;
            let ids = st
                .streams
                .iter()
                .filter(|(_, s)| s.device == device)
                .map(|(k, _)| *k)
                .collect::<Vec<u64>>();
            for &s in &ids {
                st.check_not_capturing(s, "aclrtSynchronizeDevice")?;
            }
            Ok(ids)
        })
        .and_then(|ids| synchronize_streams(&ids)),
    )
}

/// # Safety
/// `event` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut aclrtEvent) -> aclError {
    run(|st| {
        st.require_init()?;
        st.current_context()?;
        if event.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtCreateEvent: null out-pointer",
            );
        }
        let e = st.new_handle(KIND_EVENT);
        st.events.insert(e, Event::default());
        // SAFETY: checked non-null.
        unsafe { *event = e as aclrtEvent };
        Ok(())
    })
}

fn check_event(st: &State, e: u64) -> Result<(), Fail> {
    if st.events.contains_key(&e) {
        Ok(())
    } else {
        fail(
            ACL_ERROR_RT_INVALID_HANDLE,
            format!("{e:#x} is not a live aclrtEvent"),
        )
    }
}

#[no_mangle]
pub extern "C" fn aclrtDestroyEvent(event: aclrtEvent) -> aclError {
    run(|st| {
        check_event(st, event as u64)?;
        st.events.remove(&(event as u64));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream) -> aclError {
    run(|st| {
        let e = event as u64;
        check_event(st, e)?;
        let s = st.resolve_stream(stream as u64)?;
        st.check_not_capturing(s, "aclrtRecordEvent")?;
        st.events.get_mut(&e).expect("checked").recorded = false;
        st.enqueue(
            s,
            Task {
                name: "aclrtRecordEvent".into(),
                reads: Vec::new(),
                writes: Vec::new(),
                run: Box::new(move |st| {
                    if let Some(ev) = st.events.get_mut(&e) {
                        ev.recorded = true;
                        ev.time = Some(std::time::Instant::now());
                    }
                    Ok(())
                }),
            },
        );
        Ok(())
    })
}

/// The streams that may still hold the record of `e` (none once it is recorded).
fn event_streams(st: &State, e: u64) -> Vec<u64> {
    if st.events[&e].recorded {
        return Vec::new();
    }
    st.streams
        .iter()
        .filter(|(k, s)| !s.queue.is_empty() || st.busy.contains_key(k))
        .map(|(k, _)| *k)
        .collect()
}

/// Runs the streams that still hold the record of `e`, with the lock held (inside stream work;
/// a stream another thread is running meanwhile is left to it).
fn flush_event(st: &mut State, e: u64) -> Result<(), Fail> {
    for s in event_streams(st, e) {
        if !st.busy.contains_key(&s) {
            st.run_stream(s)?;
        }
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeEvent(event: aclrtEvent) -> aclError {
    finish(
        locked(|st| {
            check_event(st, event as u64)?;
            Ok(event_streams(st, event as u64))
        })
        .and_then(|ids| synchronize_streams(&ids)),
    )
}

#[no_mangle]
pub extern "C" fn aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent) -> aclError {
    run(|st| {
        let e = event as u64;
        check_event(st, e)?;
        let s = st.resolve_stream(stream as u64)?;
        st.check_not_capturing(s, "aclrtStreamWaitEvent")?;
        st.enqueue(
            s,
            Task {
                name: "aclrtStreamWaitEvent".into(),
                reads: Vec::new(),
                writes: Vec::new(),
                run: Box::new(move |st| {
                    if st.events.contains_key(&e) {
                        flush_event(st, e)
                    } else {
                        Ok(())
                    }
                }),
            },
        );
        Ok(())
    })
}

/// # Safety
/// `ms` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtEventElapsedTime(
    ms: *mut f32,
    startEvent: aclrtEvent,
    endEvent: aclrtEvent,
) -> aclError {
    run(|st| {
        check_event(st, startEvent as u64)?;
        check_event(st, endEvent as u64)?;
        let (a, b) = (
            &st.events[&(startEvent as u64)],
            &st.events[&(endEvent as u64)],
        );
        let (Some(t0), Some(t1)) = (a.time, b.time) else {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtEventElapsedTime: an event has not completed",
            );
        };
        if ms.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtEventElapsedTime: null out-pointer",
            );
        }
        // SAFETY: checked non-null.
        unsafe { *ms = t1.saturating_duration_since(t0).as_secs_f32() * 1000.0 };
        Ok(())
    })
}

/// # Safety
/// `devPtr` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(
    devPtr: *mut *mut c_void,
    size: usize,
    _policy: aclrtMemMallocPolicy,
) -> aclError {
    run(|st| {
        st.require_init()?;
        if devPtr.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: null out-pointer");
        }
        st.check_unsafe_call("aclrtMalloc")?;
        let a = st.malloc(size as u64)?;
        // SAFETY: checked non-null.
        unsafe { *devPtr = a as *mut c_void };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtFree(devPtr: *mut c_void) -> aclError {
    run(|st| {
        st.require_init()?;
        let a = devPtr as u64;
        st.check_unsafe_call("aclrtFree")?;
        if !st.device_mem.contains_key(&a) {
            st.device_range(a, 0, "aclrtFree")?;
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtFree: {a:#x} is inside an allocation, not its start"),
            );
        }
        let size = st.device_mem[&a].data.len() as u64;
        st.check_no_pending(a, size, true, "aclrtFree")?;
        st.device_mem.remove(&a);
        st.forget_derived(a, size);
        st.freed.insert(a, size);
        st.device_used -= size;
        Ok(())
    })
}

/// # Safety
/// `hostPtr` is valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocHost(hostPtr: *mut *mut c_void, size: usize) -> aclError {
    run(|st| {
        st.require_init()?;
        if hostPtr.is_null() || size == 0 {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclrtMallocHost: null out-pointer or 0 bytes",
            );
        }
        let layout = std::alloc::Layout::from_size_align(size, 4096).map_err(|e| Fail {
            code: ACL_ERROR_INVALID_PARAM,
            msg: e.to_string(),
        })?;
        // SAFETY: non-zero size layout.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return fail(
                ACL_ERROR_RT_MEMORY_ALLOCATION,
                "aclrtMallocHost: out of host memory",
            );
        }
        st.host_mem.insert(p as usize, HostAlloc { layout });
        // SAFETY: checked non-null.
        unsafe { *hostPtr = p as *mut c_void };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtFreeHost(hostPtr: *mut c_void) -> aclError {
    run(|st| {
        st.require_init()?;
        let p = hostPtr as usize;
        let Some(h) = st.host_mem.get(&p) else {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtFreeHost: {p:#x} was not returned by aclrtMallocHost"),
            );
        };
        let layout = h.layout;
        let busy =
            st.streams.values().flat_map(|s| &s.queue).any(|t| {
                t.name.starts_with("aclrtMemcpyAsync") && t.name.contains(&format!("{p:#x}"))
            });
        if busy {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                "aclrtFreeHost: a queued async copy still uses this memory",
            );
        }
        st.host_mem.remove(&p);
        // SAFETY: allocated by aclrtMallocHost with this layout and not freed before.
        unsafe { std::alloc::dealloc(p as *mut u8, layout) };
        Ok(())
    })
}

/// The registered pinned host allocation that holds `[p, p+len)`.
fn pinned(st: &State, p: usize, len: usize) -> bool {
    st.host_mem
        .iter()
        .any(|(&a, h)| p >= a && p + len <= a + h.layout.size())
}

#[derive(Clone, Copy)]
enum Side {
    Host,
    Device,
}

fn sides(st: &State, kind: aclrtMemcpyKind, dst: u64, src: u64) -> Result<(Side, Side), Fail> {
    Ok(match kind {
        ACL_MEMCPY_HOST_TO_HOST => (Side::Host, Side::Host),
        ACL_MEMCPY_HOST_TO_DEVICE => (Side::Device, Side::Host),
        ACL_MEMCPY_DEVICE_TO_HOST => (Side::Host, Side::Device),
        ACL_MEMCPY_DEVICE_TO_DEVICE => (Side::Device, Side::Device),
        ACL_MEMCPY_DEFAULT => {
            let side = |a| {
                if st.is_device(a) {
                    Side::Device
                } else {
                    Side::Host
                }
            };
            (side(dst), side(src))
        }
        _ => {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("memcpy kind {kind} is not a documented aclrtMemcpyKind"),
            )
        }
    })
}

fn check_side(st: &State, side: Side, addr: u64, len: u64, what: &str) -> Result<(), Fail> {
    if addr == 0 {
        return fail(ACL_ERROR_INVALID_PARAM, format!("{what}: null pointer"));
    }
    match side {
        Side::Device => st.device_range(addr, len, what).map(|_| ()),
        Side::Host if st.is_device(addr) => fail(
            ACL_ERROR_RT_INVALID_MEMORY_TYPE,
            format!("{what}: {addr:#x} is device memory where the copy kind says host memory"),
        ),
        Side::Host => Ok(()),
    }
}

/// # Safety
/// Host-side pointers are valid for `count` bytes (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
) -> aclError {
    run(|st| {
        st.require_init()?;
        st.current_context()?;
        st.check_unsafe_call("aclrtMemcpy")?;
        if count > destMax {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtMemcpy: count {count} exceeds destMax {destMax}"),
            );
        }
        let (d, s) = sides(st, kind, dst as u64, src as u64)?;
        check_side(st, d, dst as u64, count as u64, "aclrtMemcpy dst")?;
        check_side(st, s, src as u64, count as u64, "aclrtMemcpy src")?;
        if let Side::Device = s {
            st.check_no_pending(src as u64, count as u64, false, "aclrtMemcpy source")?;
        }
        if let Side::Device = d {
            st.check_no_pending(dst as u64, count as u64, true, "aclrtMemcpy destination")?;
        }
        copy_now(st, d, dst as u64, s, src as u64, count)
    })
}

fn copy_now(
    st: &mut State,
    d: Side,
    dst: u64,
    s: Side,
    src: u64,
    count: usize,
) -> Result<(), Fail> {
    let data: Vec<u8> = match s {
        Side::Device => st.bytes(src, count as u64)?.to_vec(),
        // SAFETY: the caller's host source holds `count` bytes (documented contract).
        Side::Host => unsafe { std::slice::from_raw_parts(src as *const u8, count) }.to_vec(),
    };
    match d {
        Side::Device => st.bytes_mut(dst, count as u64)?.copy_from_slice(&data),
        // SAFETY: the caller's host destination holds `count` bytes (documented contract).
        Side::Host => unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, count)
        },
    }
    Ok(())
}

/// # Safety
/// Host-side pointers are `aclrtMallocHost` memory valid until the stream is synchronized.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
    stream: aclrtStream,
) -> aclError {
    run(|st| {
        st.require_init()?;
        let sid = st.resolve_stream(stream as u64)?;
        if count > destMax {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtMemcpyAsync: count {count} exceeds destMax {destMax}"),
            );
        }
        let (d, s) = sides(st, kind, dst as u64, src as u64)?;
        if let (Side::Host, Side::Host) = (d, s) {
            return fail(
                ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                "aclrtMemcpyAsync does not copy host to host",
            );
        }
        if !(dst as u64).is_multiple_of(64) || !(src as u64).is_multiple_of(64) {
            return fail(
                ACL_ERROR_RT_ADDR_UNALIGNED,
                format!("aclrtMemcpyAsync: source {:#x} and destination {:#x} must both be 64-byte aligned", src as u64, dst as u64),
            );
        }
        check_side(st, d, dst as u64, count as u64, "aclrtMemcpyAsync dst")?;
        check_side(st, s, src as u64, count as u64, "aclrtMemcpyAsync src")?;
        for (side, p) in [(d, dst as u64), (s, src as u64)] {
            if let Side::Host = side {
                if !pinned(st, p as usize, count) {
                    return fail(
                        ACL_ERROR_RT_INVALID_MEMORY_TYPE,
                        format!("aclrtMemcpyAsync: host memory {p:#x} (+{count}) was not allocated with aclrtMallocHost"),
                    );
                }
            }
        }
        let (mut reads, mut writes) = (Vec::new(), Vec::new());
        if let Side::Device = s {
            reads.push((src as u64, count as u64));
        }
        match d {
            Side::Device => writes.push((dst as u64, count as u64)),
            // SAFETY: pinned host memory registered above holds `count` bytes at `dst`; the result
            // is not there until the stream runs, so it reads as poison until then.
            Side::Host => unsafe { std::ptr::write_bytes(dst as *mut u8, POISON, count) },
        }
        let (dst, src) = (dst as u64, src as u64);
        st.submit(
            sid,
            format!("aclrtMemcpyAsync({dst:#x} <- {src:#x}, {count} bytes)"),
            reads,
            writes,
            Box::new(move || Box::new(move |st| copy_now(st, d, dst, s, src, count))),
        );
        Ok(())
    })
}

fn memset_check(st: &State, p: u64, max: usize, count: usize, what: &str) -> Result<(), Fail> {
    if count > max {
        return fail(
            ACL_ERROR_INVALID_PARAM,
            format!("{what}: count {count} exceeds maxCount {max}"),
        );
    }
    st.device_range(p, count as u64, what).map(|_| ())
}

#[no_mangle]
pub extern "C" fn aclrtMemset(
    devPtr: *mut c_void,
    maxCount: usize,
    value: i32,
    count: usize,
) -> aclError {
    run(|st| {
        st.require_init()?;
        st.current_context()?;
        st.check_unsafe_call("aclrtMemset")?;
        memset_check(st, devPtr as u64, maxCount, count, "aclrtMemset")?;
        st.check_no_pending(devPtr as u64, count as u64, true, "aclrtMemset")?;
        st.bytes_mut(devPtr as u64, count as u64)?.fill(value as u8);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclrtMemsetAsync(
    devPtr: *mut c_void,
    maxCount: usize,
    value: i32,
    count: usize,
    stream: aclrtStream,
) -> aclError {
    run(|st| {
        st.require_init()?;
        let sid = st.resolve_stream(stream as u64)?;
        memset_check(st, devPtr as u64, maxCount, count, "aclrtMemsetAsync")?;
        let p = devPtr as u64;
        st.submit(
            sid,
            format!("aclrtMemsetAsync({p:#x}, {count} bytes)"),
            Vec::new(),
            vec![(p, count as u64)],
            Box::new(move || {
                Box::new(move |st| {
                    st.bytes_mut(p, count as u64)?.fill(value as u8);
                    Ok(())
                })
            }),
        );
        Ok(())
    })
}

/// # Safety
/// Out-pointers are valid.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(
    attr: aclrtMemAttr,
    free: *mut usize,
    total: *mut usize,
) -> aclError {
    run(|st| {
        st.require_init()?;
        st.current_context()?;
        if free.is_null() || total.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetMemInfo: null out-pointer");
        }
        if attr > 9 {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtGetMemInfo: {attr} is not an aclrtMemAttr"),
            );
        }
        let t = hbm_total();
        // SAFETY: checked non-null.
        unsafe {
            *total = t as usize;
            *free = (t - st.device_used) as usize;
        }
        Ok(())
    })
}

// Compile-time check: every export has the declared prototype of npu-ffi.
const _: () = {
    use npu_ffi::acl_rt::sig;
    let _: sig::aclInit = aclInit;
    let _: sig::aclFinalize = aclFinalize;
    let _: sig::aclGetRecentErrMsg = aclGetRecentErrMsg;
    let _: sig::aclrtSetDevice = aclrtSetDevice;
    let _: sig::aclrtResetDevice = aclrtResetDevice;
    let _: sig::aclrtGetDevice = aclrtGetDevice;
    let _: sig::aclrtGetDeviceCount = aclrtGetDeviceCount;
    let _: sig::aclrtCreateContext = aclrtCreateContext;
    let _: sig::aclrtDestroyContext = aclrtDestroyContext;
    let _: sig::aclrtSetCurrentContext = aclrtSetCurrentContext;
    let _: sig::aclrtGetCurrentContext = aclrtGetCurrentContext;
    let _: sig::aclrtCreateStream = aclrtCreateStream;
    let _: sig::aclrtDestroyStream = aclrtDestroyStream;
    let _: sig::aclrtSynchronizeStream = aclrtSynchronizeStream;
    let _: sig::aclrtSynchronizeDevice = aclrtSynchronizeDevice;
    let _: sig::aclrtCreateEvent = aclrtCreateEvent;
    let _: sig::aclrtDestroyEvent = aclrtDestroyEvent;
    let _: sig::aclrtRecordEvent = aclrtRecordEvent;
    let _: sig::aclrtSynchronizeEvent = aclrtSynchronizeEvent;
    let _: sig::aclrtStreamWaitEvent = aclrtStreamWaitEvent;
    let _: sig::aclrtEventElapsedTime = aclrtEventElapsedTime;
    let _: sig::aclrtMalloc = aclrtMalloc;
    let _: sig::aclrtFree = aclrtFree;
    let _: sig::aclrtMallocHost = aclrtMallocHost;
    let _: sig::aclrtFreeHost = aclrtFreeHost;
    let _: sig::aclrtMemcpy = aclrtMemcpy;
    let _: sig::aclrtMemcpyAsync = aclrtMemcpyAsync;
    let _: sig::aclrtMemset = aclrtMemset;
    let _: sig::aclrtMemsetAsync = aclrtMemsetAsync;
    let _: sig::aclrtGetMemInfo = aclrtGetMemInfo;
};
