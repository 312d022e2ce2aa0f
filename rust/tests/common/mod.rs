//! What several Rust test crates share (each declares `mod common;`).
#![allow(dead_code)] // each test crate uses a part

/// Small deterministic generator (xorshift64*), so tests need no extra dependency and a
/// failure reproduces from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// A fresh directory for one test's segment files: `<temp dir>/flagos_shm_<tag>_<pid>_<n>`.
/// Removed with whatever it holds when dropped, also when the test panics, so a failed
/// run leaves nothing in the temp directory. A test that checks for leaked segment files
/// still removes it itself first with `std::fs::remove_dir` (which fails if a file is left).
pub struct TestDir(std::path::PathBuf);

impl TestDir {
    pub fn new(tag: &str) -> TestDir {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("flagos_shm_{tag}_{}_{k}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
}

impl std::ops::Deref for TestDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TestDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
