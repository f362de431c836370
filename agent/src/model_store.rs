//! Model file location and fetching of the default model.
