//! One kind of shared-memory file, written once for the group segments and the pair
//! segments alike: a private file (mode 0600, owned by this user) in a tmpfs directory,
//! named `<prefix><32 hex digits>` (128 random bits from `getrandom`), that starts with a
//! [`HEADER_BYTES`]-byte header written by its creator before anyone else can know the
//! path and never written again:
//!
//! ```text
//! 0   magic        u64   which format (`Format::magic`)
//! 8   version      u32   bumped whenever the format's layout or protocol changes
//! 12  count        u32   the format's count: ranks of a group, slots per direction of a pair
//! 16  slot_bytes   u64
//! 24  total_bytes  u64   the file's length, `Format::bytes(count, slot_bytes)`
//! 32  creator_uid  u32
//! 36  creator_pid  u32
//! ```
//!
//! Creation (`create`): the file is made complete or not at all (`O_TMPFILE`, linked to
//! its name once filled), all its pages are reserved with `posix_fallocate` (so a full
//! tmpfs fails there with the bytes needed instead of a SIGBUS later), and its header is
//! written. Opening (`open`): the file must be a regular file (no symlink followed) owned
//! by this user with no group/other permissions, and its header is read with `pread` and
//! checked (`validate_header`) before exactly the validated size is mapped.
//!
//! Liveness of a creator: from before the file has its name until it is unlinked, the
//! creating process holds an exclusive `flock` on it (see [`release_creator_lock`]); the
//! kernel drops the lock when the process exits, however it exits. The sweep of stale files
//! (`remove_stale`) removes a file only if it can take that lock itself (without
//! waiting), so it never removes a file whose creator may be alive. A lock is seen the same
//! way by every process that shares the file system, whatever its PID namespace, unlike a
//! pid recorded in the header (which in another container may name nobody, or somebody
//! else).

use super::PAGE;
use crate::error::{Error, Result};
use memmap2::{MmapOptions, MmapRaw};
use std::ffi::CString;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::mem::offset_of;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// One file format: what tells its files apart and how their size follows from their
/// geometry. Each format is one `static` (`crate::segment::FORMAT`, `crate::p2p::FORMAT`).
pub(crate) struct Format {
    /// The header's first word.
    pub magic: u64,
    /// The format's version, bumped whenever its layout or protocol changes.
    pub version: u32,
    /// File name prefix inside the directory.
    pub prefix: &'static str,
    /// What a file of this format is called in errors (`"shared-memory segment"`).
    pub what: &'static str,
    /// What a file with another magic is not (`"not a flagos_shm {noun}"`).
    pub noun: &'static str,
    /// What the header's count counts (`"ranks"`), in errors.
    pub count: &'static str,
    /// Checks a (count, slot_bytes) pair; `InvalidArgument` naming the bad one.
    pub check_geometry: fn(usize, usize) -> Result<()>,
    /// Bytes of a file of a geometry that passed `check_geometry` (cannot overflow then).
    pub bytes: fn(usize, usize) -> usize,
    /// What to change when the directory cannot hold a new file (ends the error message).
    pub hint: &'static str,
}

/// The checks every format's `check_geometry` starts with: `count` (named `count_name` in
/// the error) in `1..=max_count`, and `slot_bytes` (named `slot_name`) a multiple of
/// [`PAGE`] between [`PAGE`] and `max_slot`.
///
/// Errors: `InvalidArgument` naming the first bad one.
pub(crate) fn check_counts(
    count_name: &str,
    count: usize,
    max_count: usize,
    slot_name: &str,
    slot_bytes: usize,
    max_slot: usize,
) -> Result<()> {
    if !(1..=max_count).contains(&count) {
        return Err(Error::InvalidArgument(format!("{count_name}: expected 1..={max_count}, got {count}")));
    }
    if !(PAGE..=max_slot).contains(&slot_bytes) || slot_bytes % PAGE != 0 {
        return Err(Error::InvalidArgument(format!(
            "{slot_name}: expected a multiple of {PAGE} between {PAGE} and {max_slot}, got {slot_bytes}"
        )));
    }
    Ok(())
}

/// The header at offset 0 (module docs). Plain data; read and written through
/// [`Header::parse`] and [`encode_header`] at the offsets of this `repr(C)` layout.
#[repr(C)]
pub(crate) struct Header {
    pub magic: u64,
    pub version: u32,
    pub count: u32,
    pub slot_bytes: u64,
    pub total_bytes: u64,
    pub creator_uid: u32,
    pub creator_pid: u32,
}

/// Bytes of the header at offset 0.
pub const HEADER_BYTES: usize = std::mem::size_of::<Header>();
const _: () = assert!(HEADER_BYTES == 40); // no padding: every byte is a field's
const _: () = assert!(HEADER_BYTES <= super::LINE);

impl Header {
    /// Decodes the header's fields from its first [`HEADER_BYTES`] bytes (native endian);
    /// `None` if `raw` is shorter.
    fn parse(raw: &[u8]) -> Option<Header> {
        let raw = raw.get(..HEADER_BYTES)?;
        let u32_at = |o: usize| u32::from_ne_bytes(raw[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_ne_bytes(raw[o..o + 8].try_into().unwrap());
        Some(Header {
            magic: u64_at(offset_of!(Header, magic)),
            version: u32_at(offset_of!(Header, version)),
            count: u32_at(offset_of!(Header, count)),
            slot_bytes: u64_at(offset_of!(Header, slot_bytes)),
            total_bytes: u64_at(offset_of!(Header, total_bytes)),
            creator_uid: u32_at(offset_of!(Header, creator_uid)),
            creator_pid: u32_at(offset_of!(Header, creator_pid)),
        })
    }

    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        let mut put = |o: usize, v: &[u8]| b[o..o + v.len()].copy_from_slice(v);
        put(offset_of!(Header, magic), &self.magic.to_ne_bytes());
        put(offset_of!(Header, version), &self.version.to_ne_bytes());
        put(offset_of!(Header, count), &self.count.to_ne_bytes());
        put(offset_of!(Header, slot_bytes), &self.slot_bytes.to_ne_bytes());
        put(offset_of!(Header, total_bytes), &self.total_bytes.to_ne_bytes());
        put(offset_of!(Header, creator_uid), &self.creator_uid.to_ne_bytes());
        put(offset_of!(Header, creator_pid), &self.creator_pid.to_ne_bytes());
        b
    }
}

/// The header bytes [`create`] writes for a file of `fmt` with this geometry, created by
/// `uid` and `pid`.
pub(crate) fn encode_header(fmt: &Format, count: u32, slot_bytes: u64, total_bytes: u64, uid: u32, pid: u32) -> [u8; HEADER_BYTES] {
    Header { magic: fmt.magic, version: fmt.version, count, slot_bytes, total_bytes, creator_uid: uid, creator_pid: pid }.encode()
}

/// Reads the header of an open file of `len` bytes with `pread`; `None` if it is shorter
/// than a header or cannot be read.
pub(crate) fn read_header(file: &File, len: u64) -> Option<Header> {
    if len < HEADER_BYTES as u64 {
        return None;
    }
    let mut raw = [0u8; HEADER_BYTES];
    file.read_exact_at(&mut raw, 0).ok()?;
    Header::parse(&raw)
}

/// The layout of a file whose header passed `validate_header`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// The header's count (ranks of a group, slots per direction of a pair); passes the
    /// format's `check_geometry` with `slot_bytes`.
    pub count: usize,
    /// Bytes of one slot.
    pub slot_bytes: usize,
    /// Bytes of the whole file: `Format::bytes(count, slot_bytes)`, which is also the
    /// file's length, so mapping this many bytes maps exactly the file.
    pub total_bytes: usize,
}

/// Checks a header of `fmt`, given as the first bytes of a file of `file_len` bytes,
/// against what the opening process expects: the count `expect` (a group's size; `None`:
/// any, as the header says) and its own effective uid `uid`. Pure: reads nothing but
/// `raw`. `raw` is untrusted (another process wrote it), so every field is checked before
/// use, in this order: length, magic, version, count, creator uid, slot size (the format's
/// `check_geometry`), total size against both the layout and `file_len`. Never panics; no
/// arithmetic on a header value can overflow.
///
/// Errors: `InvalidArgument` naming the first field that does not match.
pub(crate) fn validate_header(fmt: &Format, raw: &[u8], expect: Option<usize>, uid: u32, file_len: u64) -> Result<Geometry> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    let h = match Header::parse(raw) {
        Some(h) if file_len >= HEADER_BYTES as u64 => h,
        _ => return bad(format!("file is too small ({file_len} bytes) to hold a header of {HEADER_BYTES} bytes")),
    };
    if h.magic != fmt.magic {
        return bad(format!("bad magic {:#x}; not a flagos_shm {}", h.magic, fmt.noun));
    }
    if h.version != fmt.version {
        return bad(format!("protocol version {} but this build speaks {}", h.version, fmt.version));
    }
    let count = h.count as usize;
    if let Some(n) = expect.filter(|&n| n != count) {
        return bad(format!("created for {count} {} but this group has {n}", fmt.count));
    }
    if h.creator_uid != uid {
        return bad(format!("created by uid {} but this process runs as uid {uid}", h.creator_uid));
    }
    let Ok(slot) = usize::try_from(h.slot_bytes) else {
        return bad(format!("slot_bytes {} in the header is out of range", h.slot_bytes));
    };
    (fmt.check_geometry)(count, slot).map_err(|e| Error::InvalidArgument(format!("header: {e}")))?;
    // Bounded by check_geometry (a group: at most MAX_WORLD * 2 * MAX_SLOT_BYTES + a few pages).
    let total = (fmt.bytes)(count, slot);
    if h.total_bytes != total as u64 {
        return bad(format!("header says {} bytes but {count} {} with {slot}-byte slots need {total}", h.total_bytes, fmt.count));
    }
    if file_len != total as u64 {
        return bad(format!("size {file_len} does not match its header ({total} bytes)"));
    }
    Ok(Geometry { count, slot_bytes: slot, total_bytes: total })
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Creates a file of `fmt` in `dir` for this geometry, reserves its pages and writes its
/// header, after sweeping the directory's stale files of `fmt` ([`remove_stale`]). Returns
/// the path, which the caller publishes to its peers (the group's c10d store). The file is
/// locked by this process (its live creator) until it is unlinked.
///
/// Errors: `InvalidArgument` for a bad geometry (the format's `check_geometry`); `Io`
/// naming the path and, when the directory cannot hold the file, the bytes needed, the
/// bytes free and the format's hint.
pub(crate) fn create(fmt: &Format, dir: &Path, count: usize, slot_bytes: usize) -> Result<PathBuf> {
    (fmt.check_geometry)(count, slot_bytes)?;
    remove_stale(fmt, dir);
    let total = (fmt.bytes)(count, slot_bytes);
    let path = dir.join(format!("{}{}", fmt.prefix, random_hex()?));
    let header = encode_header(fmt, count as u32, slot_bytes as u64, total as u64, euid(), std::process::id());
    create_file(dir, &path, fmt.what, |file| {
        let map = reserve_and_map(file, dir, &path, total, fmt.what, fmt.hint)?;
        // SAFETY: the mapping is `total` >= HEADER_BYTES bytes (every format's file holds
        // at least a page), and nobody else knows the file yet, so this plain write cannot
        // race.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), map.as_mut_ptr(), HEADER_BYTES) };
        Ok(())
    })?;
    Ok(path)
}

/// An open, validated and mapped file of some format.
pub(crate) struct Mapped {
    /// Exactly the file (`geometry.total_bytes` bytes).
    pub map: MmapRaw,
    pub geometry: Geometry,
}

/// Opens the file of `fmt` at `path` and maps it, after checking that it is a regular file
/// (no symlink followed) owned by this user with no group/other permissions, and that its
/// header matches ([`validate_header`] with `expect`). The header is read with `pread` and
/// checked before anything is mapped, and exactly the validated size is mapped.
///
/// Errors: `Io` (cannot open, stat, read, map), `InvalidArgument` (not a private file of
/// this user, a header that does not match); each starts with the format's `what` and the
/// path.
pub(crate) fn open(fmt: &Format, path: &Path, expect: Option<usize>) -> Result<Mapped> {
    let ctx = |what: &str| format!("{} {}: {what}", fmt.what, path.display());
    let (file, meta) = open_private(path, &ctx)?;
    let file_len = meta.len();
    let mut raw = [0u8; HEADER_BYTES];
    if file_len >= HEADER_BYTES as u64 {
        file.read_exact_at(&mut raw, 0).map_err(|e| Error::io(ctx("cannot read the header"), e))?;
    }
    let geometry = validate_header(fmt, &raw, expect, meta.uid(), file_len).map_err(|e| Error::InvalidArgument(ctx(&e.to_string())))?;
    let map = MmapOptions::new().len(geometry.total_bytes).map_raw(&file).map_err(|e| Error::io(ctx("cannot map"), e))?;
    Ok(Mapped { map, geometry })
}

/// Opens `path` read-write (never following a symlink) and checks that it is a regular
/// file owned by this user with no group/other permissions, as [`create`] makes them;
/// errors are prefixed by `ctx`.
fn open_private(path: &Path, ctx: &dyn Fn(&str) -> String) -> Result<(File, Metadata)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| Error::io(ctx("cannot open"), e))?;
    let meta = file.metadata().map_err(|e| Error::io(ctx("cannot stat"), e))?;
    let uid = euid();
    if !meta.file_type().is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(Error::InvalidArgument(ctx(&format!(
            "expected a regular file owned by uid {uid} with mode 0600, found uid {} mode {:o}",
            meta.uid(),
            meta.mode() & 0o7777
        ))));
    }
    Ok((file, meta))
}

/// Removes the name `path` and releases this process's creator lock on it, if any (the
/// mapping stays valid). A missing file is not an error: a peer may have removed it first.
///
/// Errors: `Io` naming the path.
pub(crate) fn unlink(path: &Path) -> Result<()> {
    let r = std::fs::remove_file(path);
    // Once the name is gone no sweeper can find the file: the lock has done its job.
    release_creator_lock(path);
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("cannot unlink {}", path.display()), e)),
    }
}

/// Removes the files of `fmt` in `dir` left by crashed jobs: named `<prefix>*`, owned by
/// this user, with the format's magic, whose creator no longer holds its lock on them
/// (module docs): the sweep takes the lock without waiting and removes only files it could
/// lock. A file is unlinked as soon as its peers attached, so only a job that died during
/// set-up leaves one; this sweep, run whenever a file of `fmt` is created, bounds the leak
/// to that window. Errors are ignored (best effort). Returns the paths removed.
pub(crate) fn remove_stale(fmt: &Format, dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    let uid = euid();
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(fmt.prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW).open(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        if !meta.file_type().is_file() || meta.uid() != uid {
            continue;
        }
        let Some(h) = read_header(&file, meta.len()) else { continue };
        // The lock, not the recorded pid: in another PID namespace that pid may name nobody
        // (or another process) while the creator is alive.
        if h.magic == fmt.magic && h.creator_uid == uid && try_lock_exclusive(&file) && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// Takes an exclusive `flock` on `file` without waiting; `false` if another open file
/// description holds a lock on it.
pub(crate) fn try_lock_exclusive(file: &File) -> bool {
    // SAFETY: plain syscall on an fd we own.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// The lock a creating process holds on each of its files until it unlinks them (see the
/// module docs): the open files, by path. Dropping a `File` releases its lock.
static CREATOR_LOCKS: std::sync::Mutex<Vec<(PathBuf, File)>> = std::sync::Mutex::new(Vec::new());

/// Releases this process's creator lock on `path`, if it holds one (the file is being
/// unlinked, or its creator is giving up on it; tests use it to stand for the creator's
/// exit).
pub fn release_creator_lock(path: &Path) {
    let mut locks = CREATOR_LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    locks.retain(|(p, _)| p != path);
}

fn hold_creator_lock(path: &Path, file: File) {
    CREATOR_LOCKS.lock().unwrap_or_else(|p| p.into_inner()).push((path.to_path_buf(), file));
}

/// 128 random bits as 32 hex digits (file names: unguessable).
fn random_hex() -> Result<String> {
    let mut buf = [0u8; 16];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: writes at most `buf.len() - got` bytes into `buf[got..]`.
        let r = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom for a segment name", e));
        }
        got += r as usize;
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Creates the private file `path` in `dir` (mode 0600) complete or not at all: `fill`
/// reserves and writes it. The file is locked (this process is its live creator, see
/// [`remove_stale`]) before anyone can see it, and the lock is held until it is unlinked.
///
/// First choice: an unnamed file (`O_TMPFILE`) that gets its name only once filled, so a
/// creator killed at any point leaves nothing behind. Where the file system or `/proc`
/// refuses that, a named file: a creator killed between its creation and `fill` then
/// leaves a file that no sweep can identify (no header yet).
///
/// Errors: `Io` naming `what` and the path; whatever `fill` returns (the file is removed).
fn create_file(dir: &Path, path: &Path, what: &str, fill: impl Fn(&File) -> Result<()>) -> Result<()> {
    if let Some(file) = open_unnamed(dir) {
        // Locked before it has a name, so no sweeper ever sees it unlocked while we live.
        try_lock_exclusive(&file);
        fill(&file)?;
        if link_unnamed(&file, path).is_ok() {
            hold_creator_lock(path, file);
            return Ok(());
        }
        // Linking is refused here (no /proc, say): fall back to a named file.
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(format!("cannot create {what} {}", path.display()), e))?;
    // The lock is taken before the header is written, so a sweeper that recognises the
    // file also sees it locked while we live.
    try_lock_exclusive(&file);
    fill(&file).inspect_err(|_| {
        let _ = std::fs::remove_file(path);
    })?;
    hold_creator_lock(path, file);
    Ok(())
}

/// An unnamed file in `dir` (`O_TMPFILE`, mode 0600), or `None` where the file system or
/// kernel does not offer them.
fn open_unnamed(dir: &Path) -> Option<File> {
    OpenOptions::new().read(true).write(true).mode(0o600).custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC).open(dir).ok()
}

/// Gives the unnamed `file` the name `path` (`linkat` through `/proc/self/fd`, which
/// needs no privilege); fails if the name exists.
fn link_unnamed(file: &File, path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let from = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(io::Error::other)?;
    let to = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let rc = unsafe { libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reserves `total` bytes for `file` (to become `path` in `dir`) and maps them. Errors
/// name `what`, `path` and, for a full file system, the bytes free in `dir` and `hint`
/// (which setting to change).
fn reserve_and_map(file: &File, dir: &Path, path: &Path, total: usize, what: &str, hint: &str) -> Result<MmapRaw> {
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, total as libc::off_t) };
    if rc != 0 {
        let free = fs_bytes(dir).map_or("unknown".to_string(), |(_, free)| free.to_string());
        return Err(Error::io(
            format!(
                "cannot reserve {total} bytes for {what} {} ({free} bytes free in {}; free space there, or {hint})",
                path.display(),
                dir.display()
            ),
            io::Error::from_raw_os_error(rc),
        ));
    }
    MmapOptions::new().len(total).map_raw(file).map_err(|e| Error::io(format!("cannot map {}", path.display()), e))
}

/// (total, available) bytes of the file system holding `dir`.
pub(crate) fn fs_bytes(dir: &Path) -> Option<(u64, u64)> {
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) == 0 {
            let frsize = st.f_frsize as u64;
            Some((st.f_blocks as u64 * frsize, st.f_bavail as u64 * frsize))
        } else {
            None
        }
    }
}

/// Removes `path` after a failed attach, so that a file nobody can use does not leak, but
/// only if it looks like a file of `fmt` of this user: its name starts with the format's
/// prefix and it is a regular file (not a link) owned by this user. The path comes from
/// the group's store, not from this process, so it alone is not reason enough to delete
/// whatever file it names. Errors are ignored (best effort).
pub(crate) fn remove_if_ours(fmt: &Format, path: &Path) {
    let named = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(fmt.prefix));
    let uid = euid();
    let ours = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file() && m.uid() == uid);
    if named && ours {
        let _ = std::fs::remove_file(path);
    }
    release_creator_lock(path);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{p2p, segment};

    fn err(r: Result<Geometry>) -> String {
        r.expect_err("must be refused").to_string()
    }

    /// One validator serves both formats: each accepts its own header (sizes written out
    /// here from the layouts in the two modules' docs) and refuses the other's by magic.
    #[test]
    fn each_format_accepts_its_own_header_and_refuses_the_others() {
        let uid = euid();
        // A pair: one page of control lines, then 2 directions x 4 slots x 64 KiB.
        let pair_total = 4096 + 2 * 4 * 65536;
        let pair = encode_header(&p2p::FORMAT, 4, 65536, pair_total, uid, 1);
        let g = validate_header(&p2p::FORMAT, &pair, None, uid, pair_total).unwrap();
        assert_eq!((g.count, g.slot_bytes, g.total_bytes as u64), (4, 65536, pair_total));
        // A group of 2: header and group lines, 2 control blocks of 256 bytes, rounded up to
        // a page, then 2 ranks x 2 slots x 4 KiB.
        let seg_total = 4096 + 2 * 2 * 4096;
        let seg = encode_header(&segment::FORMAT, 2, 4096, seg_total, uid, 1);
        assert_eq!(validate_header(&segment::FORMAT, &seg, Some(2), uid, seg_total).unwrap().count, 2);
        assert!(err(validate_header(&segment::FORMAT, &pair, Some(4), uid, pair_total)).contains("not a flagos_shm segment"));
        assert!(err(validate_header(&p2p::FORMAT, &seg, None, uid, seg_total)).contains("not a flagos_shm p2p segment"));
        // The pair's own checks, in the group's words.
        assert!(err(validate_header(&p2p::FORMAT, &pair, None, uid, pair_total - 4096)).contains("does not match its header"));
        assert!(err(validate_header(&p2p::FORMAT, &pair[..20], None, uid, 20)).contains("too small"));
        let zero = encode_header(&p2p::FORMAT, 0, 65536, pair_total, uid, 1);
        assert!(err(validate_header(&p2p::FORMAT, &zero, None, uid, pair_total)).contains("header: p2p slots: expected 1..="));
        let other = encode_header(&p2p::FORMAT, 4, 65536, pair_total, uid.wrapping_add(1), 1);
        assert!(err(validate_header(&p2p::FORMAT, &other, None, uid, pair_total)).contains("created by uid"));
    }
}
