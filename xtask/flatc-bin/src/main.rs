//! Prints the path of the flatc binary that the `flatc` crate built (see Cargo.toml).
//! `cargo xtask codegen` runs this once and caches the binary under `target/flatc/`.

fn main() {
    println!("{}", flatc::flatc().display());
}
