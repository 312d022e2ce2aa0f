//! Sending and receiving on a [`Channel`]: chunking, matching by tag, the stash and the
//! acknowledgement (module docs of `crate::p2p`).

use super::*;
use crate::buffer::Buf;
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::TryLockError;
use std::time::{Duration, Instant};

impl Channel {
    /// Sends the bytes of `buf` as one message with `tag`; returns once the peer's matching
    /// receive has acknowledged it. See `Channel::send_raw` for the errors.
    pub fn send(&self, buf: &Buf<'_>, tag: i64, timeout: Duration) -> Result<()> {
        // SAFETY: a `Buf` is valid for `len()` bytes while it lives (`buffer` module docs),
        // and it is borrowed for the whole call.
        unsafe { self.send_raw(buf.as_ptr(), buf.len(), tag, timeout) }
    }

    /// Receives the next message with `tag` into `buf` (exactly its length). See
    /// `Channel::recv_raw` for the errors; `InvalidArgument` for a read-only `buf`.
    pub fn recv(&self, buf: &Buf<'_>, tag: i64, timeout: Duration) -> Result<()> {
        writable(buf)?;
        // SAFETY: as in `send`; `buf` is writable (checked above).
        unsafe { self.recv_raw(buf.as_mut_ptr(), buf.len(), tag, timeout) }
    }

    /// Like [`Channel::recv`] but returns `Ok(false)` at once when no message with `tag` is
    /// there yet (see `Channel::try_recv_raw`).
    pub fn try_recv(&self, buf: &Buf<'_>, tag: i64, timeout: Duration) -> Result<bool> {
        writable(buf)?;
        // SAFETY: as in `recv`.
        unsafe { self.try_recv_raw(buf.as_mut_ptr(), buf.len(), tag, timeout) }
    }

    /// Sends `nbytes` bytes at `ptr` as one message with `tag`; returns once the peer's
    /// matching receive has acknowledged it (and every chunk is in the ring).
    ///
    /// Errors: `Mismatch` if the receive expected another size (the peer raises too);
    /// `Timeout`, `PeerDied`, `Aborted` (then the direction is unusable: later sends fail).
    ///
    /// # Safety
    /// `ptr` must point to `nbytes` readable bytes that stay valid and unchanged for the call.
    unsafe fn send_raw(&self, ptr: *const u8, nbytes: usize, tag: i64, timeout: Duration) -> Result<()> {
        self.ready()?;
        let mut tx = lock(&self.tx);
        if let Some(b) = &tx.broken {
            return Err(Error::Aborted(format!("send to {}: the channel is unusable after an earlier failed send ({b})", self.peer)));
        }
        let what = format!("send of {nbytes} bytes (tag {tag})");
        let w = Wait { what: &what, deadline: Instant::now() + timeout, timeout };
        let seq = tx.next;
        // SAFETY: forwarded from the caller.
        let r = unsafe { self.send_message(seq, ptr, nbytes, tag, &w) };
        match r {
            Ok(()) | Err(Error::Mismatch(_)) => tx.next += 1,
            Err(ref e) => tx.broken = Some(e.to_string()),
        }
        r
    }

    /// # Safety
    /// As [`Channel::send`].
    unsafe fn send_message(&self, seq: u64, ptr: *const u8, nbytes: usize, tag: i64, w: &Wait) -> Result<()> {
        let d = self.side;
        let c = self.dir(d);
        let payload = self.payload();
        let total = nbytes as u64;
        let mut head = c.head.load(Ordering::Relaxed); // this side is the ring's only writer
        for chunk in 0..self.chunks(total) {
            let off = (chunk as usize) * payload;
            let len = payload.min(nbytes - off);
            let slots = self.slots as u64;
            self.wait_for(d, w, || head.wrapping_sub(c.tail.load(Ordering::Acquire)) < slots)?;
            let i = (head % slots) as usize;
            let hdr = self.slot_header(d, i);
            for (k, v) in [seq, tag as u64, total, off as u64, len as u64].into_iter().enumerate() {
                hdr[k].store(v, Ordering::Relaxed);
            }
            if len > 0 {
                // SAFETY: `ptr + off .. + len` is inside the caller's `nbytes` (off + len <=
                // nbytes); the slot's payload holds `payload >= len` bytes after the header;
                // the reader does not touch this slot until `head` is published below.
                unsafe { std::ptr::copy_nonoverlapping(ptr.add(off), self.slot(d, i).add(SLOT_HEADER), len) };
            }
            head += 1;
            c.head.store(head, Ordering::Release);
            self.ring(d, false);
        }
        self.wait_for(d, w, || c.ack.load(Ordering::Acquire) >> 2 > seq)?;
        let ack = c.ack.load(Ordering::Acquire);
        if ack >> 2 != seq + 1 {
            return Err(Error::Aborted(format!("{} with {}: corrupt acknowledgement {ack:#x} for message {seq}", w.what, self.peer)));
        }
        match ack & 3 {
            ACK_OK => Ok(()),
            ACK_MISMATCH => Err(Error::Mismatch(format!(
                "{} to {}: size mismatch: the matching receive expects {} bytes",
                w.what,
                self.peer,
                c.ack_bytes.load(Ordering::Relaxed)
            ))),
            s => Err(Error::Aborted(format!("{} with {}: corrupt acknowledgement status {s}", w.what, self.peer))),
        }
    }

    /// Receives the next message with `tag` into the `nbytes` bytes at `ptr`.
    ///
    /// Errors: `Mismatch` if the message has another size (drained; the sender raises too);
    /// `Timeout`, `PeerDied`, `Aborted` (mid-message: later receives fail).
    ///
    /// # Safety
    /// `ptr` must point to `nbytes` writable bytes that stay valid for the call.
    unsafe fn recv_raw(&self, ptr: *mut u8, nbytes: usize, tag: i64, timeout: Duration) -> Result<()> {
        self.ready()?;
        let mut rx = lock(&self.rx);
        // SAFETY: forwarded from the caller.
        unsafe { self.recv_locked(&mut rx, ptr, nbytes, tag, timeout, true) }.map(|_| ())
    }

    /// Like `Channel::recv_raw` but returns `Ok(false)` at once when no message with `tag` is
    /// available yet (ring empty after setting aside other tags' messages) or another
    /// thread is receiving on this channel; a message once started is read to its end.
    ///
    /// # Safety
    /// As `Channel::recv_raw`.
    unsafe fn try_recv_raw(&self, ptr: *mut u8, nbytes: usize, tag: i64, timeout: Duration) -> Result<bool> {
        self.ready()?;
        let mut rx = match self.rx.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(false),
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.recv_locked(&mut rx, ptr, nbytes, tag, timeout, false) }
    }

    /// # Safety
    /// As [`Channel::recv`].
    unsafe fn recv_locked(&self, rx: &mut RxState, ptr: *mut u8, nbytes: usize, tag: i64, timeout: Duration, block: bool) -> Result<bool> {
        if let Some(b) = &rx.broken {
            return Err(Error::Aborted(format!(
                "receive from {}: the channel is unusable after an earlier failed receive ({b})",
                self.peer
            )));
        }
        let what = format!("receive of {nbytes} bytes (tag {tag})");
        if let Some(k) = rx.stash.iter().position(|s| s.tag == tag) {
            let s = rx.stash.remove(k).expect("index from position");
            if s.data.len() != nbytes {
                return Err(Error::Mismatch(format!("{what} from {}: size mismatch: the peer sent {} bytes", self.peer, s.data.len())));
            }
            if nbytes > 0 {
                // SAFETY: `ptr` holds `nbytes` writable bytes (caller), `s.data` as many.
                unsafe { std::ptr::copy_nonoverlapping(s.data.as_ptr(), ptr, nbytes) };
            }
            return Ok(true);
        }
        let w = Wait { what: &what, deadline: Instant::now() + timeout, timeout };
        let r = loop {
            let (mtag, total) = match self.peek_start(rx, &w, block) {
                Ok(Some(h)) => h,
                Ok(None) => break Ok(false),
                Err(e) => break Err(e),
            };
            let seq = rx.next;
            if mtag == tag && total == nbytes as u64 {
                self.acknowledge(seq, ACK_OK, nbytes);
                // SAFETY: the message is `nbytes` long; forwarded from the caller.
                if let Err(e) = self.consume(rx, seq, mtag, total, Sink::Ptr(ptr), &w) {
                    break Err(e);
                }
                break Ok(true);
            }
            if mtag == tag {
                self.acknowledge(seq, ACK_MISMATCH, nbytes);
                if let Err(e) = self.consume(rx, seq, mtag, total, Sink::Discard, &w) {
                    break Err(e);
                }
                return Err(Error::Mismatch(format!("{what} from {}: size mismatch: the peer sent {total} bytes", self.peer)));
            }
            // Another tag's message: set it aside for its own receive.
            let mut data = Vec::new();
            let size = usize::try_from(total).ok().filter(|&n| data.try_reserve_exact(n).is_ok());
            if size.is_none() {
                break Err(Error::Aborted(format!(
                    "{what} from {}: cannot hold a {total}-byte message of tag {mtag} read ahead",
                    self.peer
                )));
            }
            self.acknowledge(seq, ACK_OK, total as usize);
            if let Err(e) = self.consume(rx, seq, mtag, total, Sink::Vec(&mut data), &w) {
                break Err(e);
            }
            rx.stash.push_back(Stashed { tag: mtag, data });
        };
        if let Err(ref e) = r {
            if rx.mid && rx.broken.is_none() {
                rx.broken = Some(e.to_string());
            }
        }
        r
    }

    /// Waits (or, unless `block`, only looks) for the first chunk of the next message and
    /// returns its (tag, total bytes) after checking its header.
    fn peek_start(&self, rx: &RxState, w: &Wait, block: bool) -> Result<Option<(i64, u64)>> {
        let d = 1 - self.side;
        let c = self.dir(d);
        let tail = c.tail.load(Ordering::Relaxed); // this side is the ring's only reader
        let avail = || c.head.load(Ordering::Acquire) != tail;
        if block {
            self.wait_for(d, w, avail)?;
        } else if !avail() {
            self.check_stop(w)?;
            return Ok(None);
        }
        self.check_head(c, tail, w)?;
        let hdr = self.slot_header(d, (tail % self.slots as u64) as usize);
        let (seq, tag, total, off) = (
            hdr[0].load(Ordering::Relaxed),
            hdr[1].load(Ordering::Relaxed) as i64,
            hdr[2].load(Ordering::Relaxed),
            hdr[3].load(Ordering::Relaxed),
        );
        if seq != rx.next || off != 0 {
            return Err(Error::Aborted(format!(
                "{} from {}: corrupt ring: expected the start of message {}, found message {seq} at offset {off}",
                w.what, self.peer, rx.next
            )));
        }
        Ok(Some((tag, total)))
    }

    /// The writer's head may run at most `slots` ahead of the reader's tail.
    fn check_head(&self, c: &DirCtrl, tail: u64, w: &Wait) -> Result<()> {
        let head = c.head.load(Ordering::Acquire);
        if head.wrapping_sub(tail) > self.slots as u64 {
            return Err(Error::Aborted(format!(
                "{} from {}: corrupt ring: head {head}, tail {tail}, {} slots",
                w.what, self.peer, self.slots
            )));
        }
        Ok(())
    }

    fn acknowledge(&self, seq: u64, status: u64, nbytes: usize) {
        let c = self.dir(1 - self.side);
        c.ack_bytes.store(nbytes as u64, Ordering::Relaxed);
        c.ack.store(((seq + 1) << 2) | status, Ordering::Release);
        self.ring(1 - self.side, false);
    }

    /// Reads every chunk of message `seq` (tag `tag`, `total` bytes; its first chunk is at
    /// the tail) into `sink`, checking each chunk's header, and releases the slots.
    fn consume(&self, rx: &mut RxState, seq: u64, tag: i64, total: u64, mut sink: Sink, w: &Wait) -> Result<()> {
        let d = 1 - self.side;
        let c = self.dir(d);
        let payload = self.payload() as u64;
        let mut tail = c.tail.load(Ordering::Relaxed);
        let n = self.chunks(total);
        rx.mid = true;
        for chunk in 0..n {
            self.wait_for(d, w, || c.head.load(Ordering::Acquire) != tail)?;
            self.check_head(c, tail, w)?;
            let i = (tail % self.slots as u64) as usize;
            let hdr = self.slot_header(d, i);
            let got: [u64; 5] = std::array::from_fn(|k| hdr[k].load(Ordering::Relaxed));
            let off = chunk * payload;
            let len = payload.min(total - off);
            if got != [seq, tag as u64, total, off, len] {
                return Err(Error::Aborted(format!(
                    "{} from {}: corrupt ring: chunk {chunk} of message {seq} has header {got:?}, expected {:?}",
                    w.what,
                    self.peer,
                    [seq, tag as u64, total, off, len]
                )));
            }
            // `len <= payload < slot_bytes` and `off + len <= total`, checked above.
            let (off, len) = (off as usize, len as usize);
            let src = self.slot(d, i).wrapping_add(SLOT_HEADER);
            match &mut sink {
                // SAFETY: the destination holds `total` bytes (caller of recv), off + len <=
                // total; the slot's payload is published (acquire on head) and holds `len`.
                Sink::Ptr(p) if len > 0 => unsafe { std::ptr::copy_nonoverlapping(src, p.add(off), len) },
                // SAFETY: as above; `v` has `total` bytes reserved and exactly `off` filled.
                Sink::Vec(v) if len > 0 => v.extend_from_slice(unsafe { std::slice::from_raw_parts(src, len) }),
                _ => {}
            }
            tail += 1;
            c.tail.store(tail, Ordering::Release);
            self.ring(d, false);
        }
        rx.mid = false;
        rx.next += 1;
        Ok(())
    }
}
