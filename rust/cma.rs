//! Single-copy transfers between the ranks' processes: `process_vm_readv(2)`, Linux's
//! cross-memory attach (CMA), as Open MPI's shared-memory transport uses it for large
//! messages.
//!
//! A rank reads a peer's buffer straight from the peer's address space into its own, so
//! a byte crosses between processes with one copy instead of two (into a shared segment,
//! then out of it). The kernel allows it between processes of the same user when ptrace
//! would be allowed (`PTRACE_MODE_ATTACH_REALCREDS`); Yama's `ptrace_scope` >= 1 or a
//! seccomp profile can forbid it. The communicator therefore probes every peer when the
//! group is set up (see `Communicator::attach_with`) and all ranks use single-copy
//! collectives only if every probe worked; otherwise the slot path is used. A rank whose
//! caller passes `Settings::single_copy` false (`FLAGOS_SHM_CMA=0` on the Python side)
//! turns it off for the group.
//!
//! Safety of the remote side: the peer's address and the length come from the group's
//! control blocks, but the read goes through the kernel, which checks the remote range
//! against the peer's mappings (`EFAULT` otherwise); only our own destination, whose
//! length we choose, is written. A wrong or malicious address can make a collective fail,
//! not make this process touch memory outside its own buffer.

use crate::error::{Error, Result};

/// Copies `len` bytes at `remote` in process `pid` into `local`.
///
/// Errors: `PeerDied` if the process is gone (`ESRCH`), `Io` for any other failure
/// (`EPERM`: not allowed; `EFAULT`: the remote range is not mapped).
///
/// # Safety
/// `local` must be valid for writes of `len` bytes and not used by anything else during
/// the call.
pub unsafe fn read(pid: u32, remote: u64, local: *mut u8, len: usize) -> Result<()> {
    let mut done = 0usize;
    while done < len {
        // SAFETY: done < len, so the offset stays inside the caller's `len` bytes.
        let l = libc::iovec { iov_base: unsafe { local.add(done) }.cast(), iov_len: len - done };
        let r = libc::iovec { iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: `l` describes memory the caller lets us write; the kernel validates `r`
        // against process `pid`'s mappings and fails rather than reading elsewhere.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ESRCH) => return Err(Error::PeerDied(format!("process {pid} exited during a single-copy transfer"))),
                _ => return Err(Error::io(format!("process_vm_readv of {} bytes from process {pid}", len - done), e)),
            }
        }
        if n == 0 {
            return Err(Error::io(
                format!("process_vm_readv from process {pid}"),
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "read 0 bytes"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}
