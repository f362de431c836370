//! (GGUF reader tests live in the main tree.)
