//! Single-copy transfers between the ranks' processes: `process_vm_readv(2)` and
//! `process_vm_writev(2)`, Linux's cross-memory attach (CMA), as Open MPI's shared-memory
//! transport uses it for large messages.
//!
//! A rank reads a peer's buffer straight from the peer's address space into its own (or,
//! in a broadcast's root, writes its buffer into a peer's), so a byte crosses between
//! processes with one copy instead of two (into a shared segment, then out of it). The
//! kernel allows it between processes of the same user when ptrace would be allowed
//! (`PTRACE_MODE_ATTACH_REALCREDS`); Yama's `ptrace_scope` >= 1 or a
//! seccomp profile can forbid it. The communicator therefore probes every peer when the
//! group is set up (see `Communicator::attach_with`) and all ranks use single-copy
//! collectives only if every probe worked; otherwise the slot path is used. A rank whose
//! caller passes `Settings::single_copy` false (`FLAGOS_SHM_CMA=0` on the Python side)
//! turns it off for the group.
//!
//! Safety of the remote side: the peer's address and the length come from the group's
//! control blocks, but the transfer goes through the kernel, which checks the remote range
//! against the peer's mappings (`EFAULT` otherwise). A read writes only our own
//! destination, whose length we choose: a wrong or malicious address can make it fail, not
//! make this process touch memory outside its own buffer. A write goes into the peer's
//! buffer as the peer published it (address) and as every rank agreed on it (length, the
//! descriptor step): the peer offers that range to be written, as it offers its input to
//! be read.

use crate::error::{Error, Result};

/// Which way a transfer goes: from the peer into our buffer, or from ours into the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    Read,
    Write,
}

/// Copies `len` bytes at `remote` in process `pid` into `local`, front to back.
///
/// Errors: `PeerDied` if the process is gone (`ESRCH`), `Io` for any other failure
/// (`EPERM`: not allowed; `EFAULT`: the remote range is not mapped).
///
/// # Safety
/// `local` must be valid for writes of `len` bytes and not used by anything else during
/// the call.
pub unsafe fn read(pid: u32, remote: u64, local: *mut u8, len: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { transfer(Way::Read, pid, remote, local, len, false) }
}

/// Copies `len` bytes between `local` and `remote` in process `pid` (`way`), front to back
/// or (`backward`) in [`BACKWARD_PIECE`]-byte pieces from the last one (each piece front
/// to back), in one system call with one iovec per piece.
///
/// Why backward: a collective that runs again on the same buffers alternates the two
/// orders (see `Communicator::publish`), so that each call begins where the previous one
/// ended, on the lines still in this core's cache. At about the L2's size (1 MiB read into
/// a 1 MiB buffer on a 2 MiB L2), going front to back every time evicts each line just
/// before it is needed again (least-recently-used replacement on a loop that does not quite
/// fit). On the Intel Xeon 2-vCPU VM (Sapphire Rapids class, 2 MiB L2 per core;
/// 2026-12-05, median of five interleaved rounds of 200 calls, ranks pinned) alternating
/// took a 1 MiB `dist.broadcast` from 63.6 to 58.3 us, `all_gather_into_tensor` from 55.0
/// to 49.8 and `all_to_all_single` from 61.4 to 52.4; at 64 KiB the two orders were within
/// 0.1 us, at 16 MiB alternating was 2-3 % faster.
///
/// Errors: as [`read`]. An interrupted or partial transfer is done again front to back
/// (the bytes are the same), which reports the error, if there is one.
///
/// # Safety
/// `local` valid for writes (`Read`) or reads (`Write`) of `len` bytes and not used by
/// anything else during the call. For `Write`, the remote range must be one its process
/// offers to be written (see the module's notes).
pub unsafe fn transfer(way: Way, pid: u32, remote: u64, local: *mut u8, len: usize, backward: bool) -> Result<()> {
    let piece = BACKWARD_PIECE.max(len.div_ceil(MAX_IOVECS));
    let k = len.div_ceil(piece);
    if backward && k > 1 {
        let (mut l, mut r) = (Vec::with_capacity(k), Vec::with_capacity(k));
        for i in (0..k).rev() {
            let (off, n) = (i * piece, piece.min(len - i * piece));
            // SAFETY: off + n <= len: inside the caller's `len` bytes.
            l.push(libc::iovec { iov_base: unsafe { local.add(off) }.cast(), iov_len: n });
            r.push(libc::iovec { iov_base: (remote as usize).wrapping_add(off) as *mut libc::c_void, iov_len: n });
        }
        // SAFETY: `l` describes `len` bytes of the caller's buffer (the contract); the
        // kernel checks `r` against process `pid`'s mappings; k <= MAX_IOVECS.
        let n = unsafe { vm_copy(way, pid, &l, &r) };
        if n >= 0 && n as usize == len {
            return Ok(());
        }
    }
    let what = if way == Way::Read { "process_vm_readv" } else { "process_vm_writev" };
    let mut done = 0usize;
    while done < len {
        // SAFETY: done < len, so the offset stays inside the caller's `len` bytes.
        let l = libc::iovec { iov_base: unsafe { local.add(done) }.cast(), iov_len: len - done };
        let r = libc::iovec { iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: `l` describes memory the caller lets us use this way; the kernel
        // validates `r` against process `pid`'s mappings and fails rather than going elsewhere.
        let n = unsafe { vm_copy(way, pid, &[l], &[r]) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ESRCH) => return Err(Error::PeerDied(format!("process {pid} exited during a single-copy transfer"))),
                _ => return Err(Error::io(format!("{what} of {} bytes with process {pid}", len - done), e)),
            }
        }
        if n == 0 {
            return Err(Error::io(
                format!("{what} with process {pid}"),
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "moved 0 bytes"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// `process_vm_readv` or `process_vm_writev` of the local and remote iovecs.
///
/// # Safety
/// Every local iovec is memory the caller lets the kernel write (`Read`) or read (`Write`).
unsafe fn vm_copy(way: Way, pid: u32, local: &[libc::iovec], remote: &[libc::iovec]) -> isize {
    let (l, r) = (local.len() as libc::c_ulong, remote.len() as libc::c_ulong);
    // SAFETY: the caller's contract; the slices give the kernel valid iovec arrays.
    unsafe {
        match way {
            Way::Read => libc::process_vm_readv(pid as libc::pid_t, local.as_ptr(), l, remote.as_ptr(), r, 0),
            Way::Write => libc::process_vm_writev(pid as libc::pid_t, local.as_ptr(), l, remote.as_ptr(), r, 0),
        }
    }
}

/// Copies `len` bytes from `src` to `dst` forward, or (`backward`) in [`BACKWARD_PIECE`]
/// pieces from the last: the local part of a single-copy collective, in the same order as
/// its transfers; with streaming stores when `stream` ([`crate::stream::copy_to_slot`],
/// which ends with `sfence`).
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes. They may overlap (then the copy is
/// a plain forward `memmove`, whatever `backward` and `stream` say).
pub unsafe fn copy_local(src: *const u8, dst: *mut u8, len: usize, backward: bool, stream: bool) {
    if std::ptr::eq(src, dst) {
        return; // in place: the piece is already there
    }
    let (s, d) = (src as usize, dst as usize);
    if s < d + len && d < s + len {
        // SAFETY: the caller's contract; `copy` allows overlap.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    let piece = if backward { BACKWARD_PIECE } else { len.max(1) };
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(piece);
        // SAFETY: [start, end) is inside both buffers, which do not overlap (checked above).
        unsafe { crate::stream::copy_to_slot(dst.add(start), src.add(start), end - start, stream) };
        end = start;
    }
}

/// The piece a backward [`transfer`] and [`copy_local`] go by: 256 KiB (64, 128, 256 and
/// 512 KiB measured on the Intel Xeon VM for a 1 MiB broadcast: 256 KiB was fastest, 128
/// and 512 KiB within 1.5 us of it, 64 KiB 2 us slower).
pub const BACKWARD_PIECE: usize = 256 * 1024;
/// The most iovecs one `process_vm_readv` call takes (Linux's `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;
