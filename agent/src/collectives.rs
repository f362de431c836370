//! Which collective a tensor-parallel rank runs: its device's own library (HCCL on Ascend, NCCL
//! on CUDA) when it loads and every rank of the group can form a communicator with it, else
//! the shared-memory collective staged through host memory (`HostStaged`).
//!
//! `NPU_SERVING_TP_COLLECTIVE` overrides: `host` always stages through host memory, `device`
//! requires the device library (the rank fails to load otherwise), `auto` (the default) picks
//! as above. Whatever is picked is logged with the collective's own description.
//!
//! Forming a device communicator takes the group's host collective through the same steps on
//! every rank, so that every rank takes the same branch: (1) every rank says whether the library
//! loaded (an all-reduce of one flag); (2) rank 0 makes the communicator's id (HCCL's 4108-byte
//! root info, NCCL's 128-byte unique id) and it reaches the others through the group's
//! shared-memory region (an all-gather in which only rank 0's part counts: the bytes two to a
//! value, exactly representable in f32, after a flag saying whether rank 0 made one); (3) every
//! rank joins the communicator, and says whether it could (another all-reduce of one flag). A
//! rank whose library joined while another failed drops its communicator, and all fall back.

use npu_backend::{BackendError, HostCollective};

/// What `NPU_SERVING_TP_COLLECTIVE` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Auto,
    Host,
    Device,
}

/// The variable naming the choice.
pub const CHOICE_VAR: &str = "NPU_SERVING_TP_COLLECTIVE";

impl Choice {
    /// From the environment (unset or empty: `auto`).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(CHOICE_VAR).unwrap_or_default().trim() {
            "" | "auto" => Ok(Self::Auto),
            "host" => Ok(Self::Host),
            "device" => Ok(Self::Device),
            other => Err(format!(
                "{CHOICE_VAR}={other:?}: expected auto, host or device"
            )),
        }
    }
}

/// True on every rank when `ok` is true on every rank.
pub fn agree(host: &mut dyn HostCollective, ok: bool) -> Result<bool, BackendError> {
    let mut v = [if ok { 1.0f32 } else { 0.0 }];
    host.all_reduce_sum(&mut v)?;
    Ok(v[0] == host.size() as f32)
}

/// Rank 0's `bytes` (`len` of them; None: rank 0 has none to give) on every rank, through the
/// host collective; the other ranks pass None. None on every rank when rank 0 had none.
pub fn broadcast_from_root(
    host: &mut dyn HostCollective,
    bytes: Option<&[u8]>,
    len: usize,
) -> Result<Option<Vec<u8>>, BackendError> {
    let per_rank = 1 + len.div_ceil(2);
    let mut mine = vec![0f32; per_rank];
    if host.rank() == 0 {
        if let Some(b) = bytes.filter(|b| b.len() == len) {
            mine[0] = 1.0;
            for (i, pair) in b.chunks(2).enumerate() {
                let hi = pair.get(1).copied().unwrap_or(0) as u32;
                mine[1 + i] = (pair[0] as u32 | hi << 8) as f32;
            }
        }
    }
    let mut all = vec![0f32; per_rank * host.size()];
    host.all_gather(&mine, &mut all)?;
    let root = &all[..per_rank];
    if root[0] != 1.0 {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(len);
    for &v in &root[1..] {
        let v = v as u32;
        out.push((v & 0xff) as u8);
        out.push((v >> 8) as u8);
    }
    out.truncate(len);
    Ok(Some(out))
}

/// Why a device communicator was not formed, with the host collective handed back.
pub type NotFormed = (String, Box<dyn HostCollective>);

/// How `form` reaches the host collective inside a formed collective `C`, and takes it back.
pub struct HostOf<C> {
    pub host: fn(&mut C) -> &mut dyn HostCollective,
    pub unform: fn(C) -> Box<dyn HostCollective>,
}

/// Forms the device library's communicator on backend `b` (see the module's steps): `loaded`
/// says whether this rank's library loaded (or why not), `make_id` makes rank 0's id of
/// `id_len` bytes, `join` joins with it. Every rank of the group must call this at the same
/// point; it returns the same outcome on every rank.
#[allow(clippy::too_many_arguments)]
pub fn form<B, C>(
    b: &mut B,
    mut host: Box<dyn HostCollective>,
    library: &str,
    loaded: Result<(), String>,
    id_len: usize,
    make_id: impl FnOnce(&mut B) -> Result<Vec<u8>, BackendError>,
    join: impl FnOnce(
        &mut B,
        &[u8],
        Box<dyn HostCollective>,
    ) -> Result<C, (BackendError, Box<dyn HostCollective>)>,
    host_of: HostOf<C>,
) -> Result<C, NotFormed> {
    let rank = host.rank();
    macro_rules! host_step {
        ($e:expr) => {
            match $e {
                Ok(v) => v,
                Err(e) => {
                    return Err((
                        format!("the group's host collective failed while forming {library}: {e}"),
                        host,
                    ))
                }
            }
        };
    }
    let all_loaded = host_step!(agree(host.as_mut(), loaded.is_ok()));
    if !all_loaded {
        let why = match loaded {
            Err(e) => format!("{library} did not load on rank {rank}: {e}"),
            Ok(()) => format!("{library} did not load on another rank of the group"),
        };
        return Err((why, host));
    }
    let id = if rank == 0 {
        match make_id(b) {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::warn!(rank, "{library}: making the communicator's id failed: {e}");
                None
            }
        }
    } else {
        None
    };
    let id = host_step!(broadcast_from_root(host.as_mut(), id.as_deref(), id_len));
    let Some(id) = id else {
        return Err((
            format!("{library}: rank 0 could not make the communicator's id"),
            host,
        ));
    };
    // `join` holds the host collective while it waits; on failure it hands it back.
    match join(b, &id, host) {
        Ok(mut c) => match agree((host_of.host)(&mut c), true) {
            Ok(true) => Ok(c),
            Ok(false) => Err((
                format!("{library}: another rank of the group could not join the communicator"),
                (host_of.unform)(c),
            )),
            Err(e) => Err((
                format!("the group's host collective failed while forming {library}: {e}"),
                (host_of.unform)(c),
            )),
        },
        Err((e, mut host)) => {
            let why = format!("{library}: rank {rank} could not join the communicator: {e}");
            // The others are told (they drop theirs); the result is known to be false.
            let _ = agree(host.as_mut(), false);
            Err((why, host))
        }
    }
}

/// The HCCL communicator of an Ascend rank, formed through the group's host collective (see
/// [`form`]); no fallback here: the caller decides.
#[cfg(feature = "ascend")]
pub fn hccl(
    b: &mut npu_backend_ascend::AscendBackend,
    host: Box<dyn HostCollective>,
) -> Result<npu_backend_ascend::backend::hccl::HcclCollective<Box<dyn HostCollective>>, NotFormed> {
    use npu_backend_ascend::backend::hccl::{self, HcclCollective, HCCL_ROOT_INFO_BYTES};
    form(
        b,
        host,
        "HCCL",
        hccl::library().map(|_| ()),
        HCCL_ROOT_INFO_BYTES,
        |b| hccl::root_info(b).map(|r| r.to_vec()),
        |b, id, host| match <&[u8; HCCL_ROOT_INFO_BYTES]>::try_from(id) {
            Ok(root) => HcclCollective::join(b, root, host),
            Err(_) => Err((
                BackendError::BadArgument {
                    op: "HcclCommInitRootInfo",
                    message: format!("a root info of {} bytes", id.len()),
                },
                host,
            )),
        },
        HostOf {
            host: |c| c.host_mut().as_mut(),
            unform: |c| c.into_host(),
        },
    )
}

/// The NCCL communicator of a CUDA rank, formed like [`hccl`]'s. Never run: no GPU machine
/// has run it, and the CPU emulation of the kernels has no NCCL (it answers "did not load").
#[cfg(feature = "cuda")]
pub fn nccl(
    b: &mut npu_backend_cuda::CudaBackend,
    host: Box<dyn HostCollective>,
) -> Result<npu_backend_cuda::nccl::NcclCollective<Box<dyn HostCollective>>, NotFormed> {
    use npu_backend_cuda::nccl::{self, NcclCollective, NCCL_UNIQUE_ID_BYTES};
    // The emulated device has no CUDA stream: NCCL cannot run there whether or not it loads.
    let loaded = match nccl::library() {
        Ok(_) if !b.has_cuda_stream() => {
            Err("the CPU emulation of the CUDA kernels has no NCCL".to_string())
        }
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    form(
        b,
        host,
        "NCCL",
        loaded,
        NCCL_UNIQUE_ID_BYTES,
        |b| nccl::unique_id(b).map(|r| r.to_vec()),
        |b, id, host| match <&[u8; NCCL_UNIQUE_ID_BYTES]>::try_from(id) {
            Ok(uid) => NcclCollective::join(b, uid, host),
            Err(_) => Err((
                BackendError::BadArgument {
                    op: "ncclCommInitRank",
                    message: format!("a unique id of {} bytes", id.len()),
                },
                host,
            )),
        },
        HostOf {
            host: |c| c.host_mut().as_mut(),
            unform: |c| c.into_host(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rank alone: the broadcast gives back exactly the bytes (every value 0..=255 at every
    /// position, an odd length), and a missing id is None.
    struct Solo;
    impl HostCollective for Solo {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            1
        }
        fn describe(&self) -> String {
            "solo".into()
        }
        fn all_reduce_sum(&mut self, _x: &mut [f32]) -> Result<(), BackendError> {
            Ok(())
        }
        fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
            out.copy_from_slice(mine);
            Ok(())
        }
        fn gather_to_root(
            &mut self,
            mine: &[f32],
            out: Option<&mut [f32]>,
        ) -> Result<(), BackendError> {
            if let Some(o) = out {
                o.copy_from_slice(mine);
            }
            Ok(())
        }
    }

    #[test]
    fn the_root_bytes_survive_the_f32_encoding() {
        let bytes: Vec<u8> = (0..4109usize).map(|i| (i * 131 % 256) as u8).collect();
        let got = broadcast_from_root(&mut Solo, Some(&bytes), bytes.len()).unwrap();
        assert_eq!(got.as_deref(), Some(&bytes[..]));
        assert_eq!(broadcast_from_root(&mut Solo, None, 4108).unwrap(), None);
        // A wrong length from rank 0 is no id at all.
        assert_eq!(
            broadcast_from_root(&mut Solo, Some(&bytes[..10]), 4108).unwrap(),
            None
        );
        assert!(agree(&mut Solo, true).unwrap());
        assert!(!agree(&mut Solo, false).unwrap());
    }
}
