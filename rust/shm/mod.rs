//! The shared-memory layer that group segments (`crate::segment`) and point-to-point pair
//! segments (`crate::p2p`) both stand on: `file`, one kind of private, locked,
//! self-describing file in a tmpfs (header, creation, opening, the sweep of stale files,
//! the creator's lock), and `wait`, how a process waits for a word another process
//! changes (spin, yield, then sleep on a futex doorbell in bounded slices) and how it tells
//! that a peer process is gone.
//!
//! A file format is described once, by a `file::Format` (magic, version, name prefix,
//! geometry check and size), and everything else here is written once for both.

pub mod file;
pub(crate) mod wait;

/// Cache-line stride used to separate words written by different processes (128, so that
/// no two writers' hot words share a line or an adjacent-line prefetch pair).
pub(crate) const LINE: usize = 128;
/// Page size assumed for alignment (x86-64 and aarch64 Linux base pages are <= 64 KiB; we
/// only need 4 KiB multiples for `posix_fallocate` and huge-page-free tmpfs).
pub(crate) const PAGE: usize = 4096;
