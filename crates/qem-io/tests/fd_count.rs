//! The in-process index cache must not hold file descriptors once the sources it indexed are
//! dropped. Its own test binary: counting `/proc/self/fd` needs no other test running.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use qem_core::Shape2;
use qem_io::{OpenOptions, Source};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[test]
fn dropped_sources_leave_no_open_files_behind() {
    let dir = tempfile::tempdir().unwrap();
    let masters: Vec<_> = (0..6)
        .map(|i| common::small_acquisition(dir.path(), &format!("fd{i}"), Shape2::new(3, 3), 3))
        .collect();
    let baseline = open_fds();
    for round in 0..2 {
        for m in &masters {
            let src = Source::open(m, &OpenOptions::default()).unwrap();
            assert_eq!(src.files.len(), 4);
            assert_eq!(src.index_from_cache, round == 1 && !cache_disabled());
            assert!(open_fds() >= baseline + 4);
            drop(src);
        }
        assert_eq!(open_fds(), baseline, "round {round}: descriptors left open");
    }
}

fn cache_disabled() -> bool {
    std::env::var_os("QUANTEM_GPU_NO_INDEX_CACHE").is_some_and(|v| v != "0" && !v.is_empty())
}
