//! Without CANN (and without the emulation) the backend refuses to start, naming the library it
//! looked for, where, and how to get it — never a panic. Its own test binary: the runtime is
//! loaded once per process.

use npu_backend::BackendError;
use npu_backend_ascend::{AscendBackend, AscendConfig};

#[test]
fn starting_without_cann_names_the_missing_library() {
    let empty = std::env::temp_dir().join(format!("no-cann-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    std::env::set_var("ASCEND_HOME_PATH", &empty);
    std::env::remove_var("ASCEND_TOOLKIT_HOME");
    std::env::remove_var("LD_LIBRARY_PATH");
    let Err(e) = AscendBackend::new(AscendConfig::default()) else {
        panic!("the backend started without CANN");
    };
    assert!(matches!(e, BackendError::MissingLibrary { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("libascendcl.so") && msg.contains("set_env.sh") && msg.contains("no-cann-"),
        "{msg}"
    );
    // A second start gives the same answer (the runtime is loaded once per process).
    let again = AscendBackend::new(AscendConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert_eq!(again, msg);
    std::fs::remove_dir_all(&empty).unwrap();
}
