//! Sampler.
