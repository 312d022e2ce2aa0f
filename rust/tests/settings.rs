//! The core reads no environment: a communicator's settings are what its caller passes
//! (`group::Settings`), whatever the `FLAGOS_SHM_*` variables the Python side reads say.
//! One test (one process): it sets the variables to the opposite of what it passes.

use flagos_shm::progress::Progress;
use flagos_shm::segment;
use flagos_shm::stream::Mode;
use flagos_shm::Communicator;
use flagos_shm::Plan;
use flagos_shm::Settings;
use std::time::Duration;

mod common;
use common::TestDir;

/// A 2-rank group attached by two threads of this process, each with `settings`; returns
/// rank 0's `(single_copy_available, plan, stream_mode)`.
fn attach_pair(tag: &str, settings: Settings) -> (bool, Plan, Mode) {
    let dir = TestDir::new(&format!("settings_{tag}"));
    let path = segment::create(&dir, 2, 1 << 16).unwrap();
    let t = Duration::from_secs(30);
    let peer = {
        let path = path.clone();
        std::thread::spawn(move || Communicator::attach_with(&path, 1, 2, t, None, &[], settings).map(drop))
    };
    let comm = Communicator::attach_with(&path, 0, 2, t, None, &[], settings).unwrap();
    let seen = (comm.single_copy_available(), comm.plan(), comm.stream_mode());
    assert_eq!(comm.settings(), settings);
    drop(Progress::new(comm));
    peer.join().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    seen
}

#[test]
fn the_core_obeys_the_settings_passed_and_ignores_the_environment() {
    let on = Settings { single_copy: true, stream: Mode::Plain, progress_batch: true };
    let off = Settings { single_copy: false, stream: Mode::Stream, progress_batch: false };
    // The variables the core used to read, set against each setting below. The test
    // binary has only this test, so no other thread reads the environment meanwhile.
    std::env::set_var("FLAGOS_SHM_CMA", "0");
    std::env::set_var("FLAGOS_SHM_CMA_MIN_BYTES", "123");
    std::env::set_var("FLAGOS_SHM_STREAM", "always");
    std::env::set_var("FLAGOS_SHM_PROGRESS_BATCH", "0");
    let (available, plan, mode) = attach_pair("on", on);
    assert_eq!(mode, Mode::Plain, "stream: the passed mode, not FLAGOS_SHM_STREAM=always");
    // Single-copy needs process_vm_readv, which a seccomp profile may forbid: where the
    // probe works the plan's bands apply, whatever FLAGOS_SHM_CMA=0 or the retired
    // FLAGOS_SHM_CMA_MIN_BYTES say.
    let expected = if available { Plan::FALLBACK } else { Plan::FALLBACK.without_single_copy() };
    assert_eq!(plan, expected, "single_copy true: the fallback plan, its bands as they are");
    std::env::set_var("FLAGOS_SHM_CMA", "1");
    std::env::set_var("FLAGOS_SHM_STREAM", "never");
    let (available, plan, mode) = attach_pair("off", off);
    assert_eq!((available, mode), (false, Mode::Stream), "single_copy false and stream: the passed values");
    assert_eq!(plan, Plan::FALLBACK.without_single_copy(), "a group without single-copy runs no band");
    assert_eq!(Settings::default(), Settings { single_copy: true, stream: Mode::Auto, progress_batch: true });
}
