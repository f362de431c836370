//! The YAML config reader (llm-serving's schema), strict and lenient: a config is read, or
//! refused with an error naming its key; then what the server derives from a read config.

use npu_server::config::ServerConfig;

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    match ServerConfig::from_yaml_str_with(text, mode & 1 == 1) {
        Ok(cfg) => {
            let _ = (
                cfg.decode_batch_size(),
                cfg.prefill_batch_size(),
                cfg.seq_length(),
            );
            for context in [0, 1, 2048, u32::MAX] {
                let _ = cfg.max_model_len(context);
                let _ = cfg.longest_sequence(context);
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}
