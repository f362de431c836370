//! The one user-facing binary: parses the command line and hands over to the library crates.

fn main() {
    println!("npu-serving");
}
