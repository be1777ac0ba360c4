//! The fuzz target's committed corpus, replayed through the same code on the stable toolchain
//! (the CI's short cargo-fuzz run explores beyond it).

#[test]
fn the_fuzz_corpus_replays_without_a_panic() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/frame_decoder");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        spindle_wire::fuzzing::frame_decoder(&data);
        n += 1;
    }
    assert!(
        n >= 10,
        "the corpus has its seeds ({n} found in {})",
        dir.display()
    );
}
