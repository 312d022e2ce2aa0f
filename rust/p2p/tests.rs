//! Unit tests of the point-to-point channels (two sides in one process).

use super::*;
use crate::buffer::Buf;
use std::sync::Arc;

fn pair(slots: usize, slot_bytes: usize) -> (tempdir::Dir, Arc<Channel>, Arc<Channel>) {
    let dir = tempdir::Dir::new();
    let path = create(&dir.0, slots, slot_bytes).unwrap();
    let me = std::process::id();
    let a = Channel::open(&path, 0, me, "rank 1").unwrap();
    assert!(path.exists());
    let b = Channel::open(&path, 1, me, "rank 0").unwrap();
    assert!(!path.exists(), "unlinked once both sides attached");
    (dir, Arc::new(a), Arc::new(b))
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
            let p = base.join(format!("flagos_p2p_test_{}_{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], ""));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let left: Vec<_> = std::fs::read_dir(&self.0).unwrap().flatten().map(|e| e.path()).collect();
            let _ = std::fs::remove_dir_all(&self.0);
            assert!(left.is_empty() || std::thread::panicking(), "files left: {left:?}");
        }
    }
}

const T: Duration = Duration::from_secs(20);

fn send(c: &Channel, data: &[u8], tag: i64, t: Duration) -> Result<()> {
    c.send(&Buf::from_slice(data), tag, t)
}

fn recv(c: &Channel, out: &mut [u8], tag: i64, t: Duration) -> Result<()> {
    c.recv(&Buf::from_mut_slice(out), tag, t)
}

fn try_recv(c: &Channel, out: &mut [u8], tag: i64, t: Duration) -> Result<bool> {
    c.try_recv(&Buf::from_mut_slice(out), tag, t)
}

#[test]
fn streams_any_size_in_order_per_tag() {
    let (_d, a, b) = pair(2, 4096);
    let sizes = [0usize, 1, 4031, 4032, 4033, 100_003];
    let msgs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|k| (k * 7 + i) as u8).collect()).collect();
    let sent = msgs.clone();
    let tx = std::thread::spawn(move || {
        for (i, m) in sent.iter().enumerate() {
            // tags: 0, 1, 0, 1, ... (the receiver asks for tag 1 first)
            send(&a, m, (i % 2) as i64, T).unwrap();
        }
    });
    // All tag-1 messages first, then tag 0: tag-0 ones are stashed, order kept per tag.
    let order: Vec<usize> = (0..sizes.len()).filter(|i| i % 2 == 1).chain((0..sizes.len()).filter(|i| i % 2 == 0)).collect();
    for i in order {
        let mut out = vec![0xAAu8; sizes[i]];
        recv(&b, &mut out, (i % 2) as i64, T).unwrap();
        assert_eq!(out, msgs[i], "message {i}");
    }
    tx.join().unwrap();
}

#[test]
fn size_mismatch_raises_on_both_sides_and_channel_stays_usable() {
    let (_d, a, b) = pair(2, 4096);
    let a2 = Arc::clone(&a);
    let tx = std::thread::spawn(move || {
        let big = vec![1u8; 10_000];
        let e = send(&a2, &big, 3, T).unwrap_err();
        assert!(matches!(e, Error::Mismatch(_)) && e.to_string().contains("expects 16 bytes"), "{e}");
        let ok = [9u8; 5];
        send(&a2, &ok, 3, T).unwrap();
    });
    let mut out = [0u8; 16];
    let e = recv(&b, &mut out, 3, T).unwrap_err();
    assert!(matches!(e, Error::Mismatch(_)) && e.to_string().contains("sent 10000 bytes"), "{e}");
    let mut five = [0u8; 5];
    recv(&b, &mut five, 3, T).unwrap();
    assert_eq!(five, [9u8; 5]);
    tx.join().unwrap();
}

#[test]
fn timeout_abort_and_close_end_waits() {
    let (_d, a, b) = pair(1, 4096);
    let t0 = Instant::now();
    let x = [0u8; 8];
    let e = send(&a, &x, 0, Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("rank 1"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // The failed send left the ring half-used: later sends say so at once.
    let e = send(&a, &x, 0, T).unwrap_err();
    assert!(e.to_string().contains("unusable"), "{e}");
    // A receive waiting on the peer ends when the peer aborts.
    let b2 = Arc::clone(&b);
    let waiter = std::thread::spawn(move || {
        let mut y = [0u8; 8];
        // The stale message of the failed send is matched first (8 bytes, tag 0); a
        // second receive then waits until the abort.
        recv(&b2, &mut y, 0, T).unwrap();
        recv(&b2, &mut y, 0, T).unwrap_err()
    });
    std::thread::sleep(Duration::from_millis(50));
    a.abort();
    let e = waiter.join().unwrap();
    assert!(matches!(e, Error::Aborted(_)) && e.to_string().contains("aborted"), "{e}");
}

#[test]
fn try_recv_does_not_block_and_open_checks_the_file() {
    let (d, a, b) = pair(2, 4096);
    let mut y = [0u8; 4];
    assert!(!try_recv(&b, &mut y, 0, T).unwrap());
    let a2 = Arc::clone(&a);
    let tx = std::thread::spawn(move || send(&a2, &[1u8, 2, 3, 4], 0, T).unwrap());
    while !try_recv(&b, &mut y, 0, T).unwrap() {
        std::thread::yield_now();
    }
    assert_eq!(y, [1, 2, 3, 4]);
    tx.join().unwrap();
    let junk = d.0.join("flagos_shm-p2p-junk");
    std::fs::write(&junk, [0u8; 64]).unwrap();
    let mut perm = std::fs::metadata(&junk).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o600);
    std::fs::set_permissions(&junk, perm).unwrap();
    let e = Channel::open(&junk, 0, 0, "x").err().unwrap();
    assert!(e.to_string().contains("bad magic"), "{e}");
    std::fs::remove_file(&junk).unwrap();
    assert!(check_geometry(0, 4096).is_err() && check_geometry(4, 1000).is_err());
}

#[test]
fn a_new_pair_file_is_complete_and_locked_by_its_creator() {
    let dir = tempdir::Dir::new();
    let path = create(&dir.0, DEFAULT_SLOTS, DEFAULT_SLOT_BYTES).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    assert!(!file::try_lock_exclusive(&f), "the creator holds the file's lock");
    let h = file::read_header(&f, f.metadata().unwrap().len()).expect("a header");
    assert_eq!((h.magic, h.count as usize, h.creator_pid), (MAGIC, DEFAULT_SLOTS, std::process::id()));
    assert!(file::remove_stale(&FORMAT, &dir.0).is_empty(), "a live creator's file is never swept");
    file::release_creator_lock(&path);
    std::fs::remove_file(&path).unwrap();
}
