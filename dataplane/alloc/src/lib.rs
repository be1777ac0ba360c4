//! The global allocator of spindle's binaries: the system allocator, with every block of
//! [`LARGE`] bytes or more aligned to 2 MiB and advised onto transparent huge pages.
//!
//! A shard's big tables (task cells, links, the task index, tenant and user records) are a few
//! large vectors read at random: with 4 KiB pages a pick's loads miss the TLB as well as the
//! cache, and on a machine whose L3 does not hold the shard a page walk rides on most misses.
//! Linux hands out huge pages for advised memory when `transparent_hugepage/enabled` is
//! `madvise` (the common default) or `always`; where it is `never`, or on other systems, the
//! advice is not taken and blocks are plain system blocks. Small allocations are untouched.
//!
//! ```
//! #[global_allocator]
//! static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;
//!
//! let table: Vec<u64> = vec![0; 1 << 20]; // 8 MiB: on huge pages
//! assert_eq!(table.as_ptr() as usize % (2 << 20), 0);
//! ```
#![allow(unsafe_code)] // a global allocator is unsafe by contract; each block says why it holds

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks this large or larger are placed on huge pages.
pub const LARGE: usize = 4 << 20;

/// The size of a transparent huge page on x86-64 and most arm64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// The system allocator, with large blocks on transparent huge pages.
#[derive(Debug, Default, Clone, Copy)]
pub struct HugePages;

/// The layout a block of `layout` is allocated with: large ones aligned to a huge page, so
/// that their whole pages can be huge (the kernel maps a huge page only where it is aligned).
fn placed(layout: Layout) -> Layout {
    if layout.size() < LARGE {
        return layout;
    }
    // An alignment of 2 MiB is a power of two at least as large as any the layout had, and a
    // size below isize::MAX stays valid when rounded to it (a large block of that size could
    // not be allocated anyway; `from_size_align` says so rather than overflow).
    Layout::from_size_align(layout.size(), layout.align().max(HUGE_PAGE)).unwrap_or(layout)
}

/// Advises the block's memory onto huge pages. A hint: the answer is not needed (without THP
/// the block simply stays on small pages).
fn advise(ptr: *mut u8, size: usize) {
    #[cfg(target_os = "linux")]
    if !ptr.is_null() && size >= LARGE {
        // SAFETY: `ptr..ptr + size` is a block this allocator just allocated and owns; the
        // advice changes how its pages are backed, never their contents or mapping.
        unsafe {
            libc::madvise(ptr.cast(), size, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, size);
}

// SAFETY: every method forwards to `System` with the layout `placed` gives, the same one at a
// block's allocation and at its release (it depends on the size and alignment only), so each
// block `System` hands out is given back to it with the layout it was allocated with.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: `placed` keeps the size (non-zero, as the caller's contract says).
        let ptr = unsafe { System.alloc(placed(layout)) };
        advise(ptr, layout.size());
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let ptr = unsafe { System.alloc_zeroed(placed(layout)) };
        advise(ptr, layout.size());
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with `layout`, so from `System` with `placed(layout)`.
        unsafe { System.dealloc(ptr, placed(layout)) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < LARGE && new_size < LARGE {
            // SAFETY: both layouts are the caller's own (`placed` leaves small ones as they are).
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Into or out of the large placement: a new block, the contents copied, the old one
        // released (`System.realloc` would keep the old alignment).
        // SAFETY: the caller's contract makes `new_size` with the old alignment a valid layout.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: non-zero size, as the caller's contract says.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and distinct, and each holds at least the bytes
            // copied; `ptr` was allocated here with `layout`.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_are_placed_on_huge_page_boundaries_and_small_ones_are_not_moved() {
        let small = Layout::from_size_align(4096, 8).unwrap();
        assert_eq!(placed(small), small);
        let large = Layout::from_size_align(LARGE, 64).unwrap();
        assert_eq!(placed(large).align(), HUGE_PAGE);
        assert_eq!(placed(large).size(), LARGE);
        let a = HugePages;
        // SAFETY: non-zero sizes; each block is released with the layout it was allocated with.
        unsafe {
            let p = a.alloc(large);
            assert!(!p.is_null());
            assert_eq!(
                p as usize % HUGE_PAGE,
                0,
                "a large block starts on a huge page"
            );
            p.write_bytes(7, LARGE);
            // Growing keeps the contents, and shrinking below the threshold as well.
            let q = a.realloc(p, large, 3 * LARGE);
            assert!(!q.is_null());
            assert_eq!(q as usize % HUGE_PAGE, 0);
            assert_eq!((*q, *q.add(LARGE - 1)), (7, 7));
            let grown = Layout::from_size_align(3 * LARGE, 64).unwrap();
            let r = a.realloc(q, grown, 100);
            assert!(!r.is_null());
            assert_eq!((*r, *r.add(99)), (7, 7));
            a.dealloc(r, Layout::from_size_align(100, 64).unwrap());
            let z = a.alloc_zeroed(large);
            assert!(!z.is_null());
            assert_eq!((*z, *z.add(LARGE - 1)), (0, 0));
            a.dealloc(z, large);
        }
    }

    #[test]
    fn vectors_grow_and_shrink_through_it() {
        let mut v: Vec<u64> = Vec::new();
        for i in 0..(3 * LARGE / 8) as u64 {
            v.push(i);
        }
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
        v.truncate(10);
        v.shrink_to_fit();
        assert_eq!(v, (0..10).collect::<Vec<u64>>());
    }

    /// Where the kernel offers transparent huge pages for advised memory, a large block gets
    /// them (read back from `/proc/self/smaps`). Elsewhere blocks stay on small pages, which
    /// the tests above cover.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_block_is_backed_by_huge_pages_where_the_kernel_offers_them() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        let offered = thp.contains("[madvise]") || thp.contains("[always]");
        let mut block = vec![1u8; 2 * LARGE];
        block.iter_mut().step_by(4096).for_each(|b| *b = 2);
        let at = block.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let huge_kb = huge_kb_of_mapping(&smaps, at).expect("the block's mapping in smaps");
        if offered {
            assert!(
                huge_kb >= 2048,
                "THP is {thp:?} but the block has {huge_kb} kB on huge pages"
            );
        }
        assert_eq!(block[4096], 2);
    }

    /// `AnonHugePages` of the mapping that contains `addr`.
    fn huge_kb_of_mapping(smaps: &str, addr: usize) -> Option<u64> {
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    return kb.trim().trim_end_matches("kB").trim().parse().ok();
                }
            }
        }
        None
    }

    #[global_allocator]
    static ALLOC: HugePages = HugePages;
}
