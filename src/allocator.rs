//! The global allocator of the binary and the benches: mimalloc, asked the way C asks it.
//!
//! Why mimalloc: glibc's malloc queued the worker threads on its arena lock (BENCHMARKS.md);
//! mimalloc's heaps are per thread.
//!
//! Why not the `mimalloc` crate's own `MiMalloc`: it sends every allocation through
//! `mi_malloc_aligned`, even at alignment 8. mimalloc 3 answers that from its fast path only for
//! blocks up to 1 KiB; a larger one whose size is not a power of two is over-allocated by the
//! alignment and its page marked as holding interior pointers, which every later free on that
//! page pays for. A gRPC call makes about eight such allocations (h2's and tonic's buffers, boxed
//! futures): under callgrind, 1 700 instructions a call of 51 000 went to that path alone. Every
//! mimalloc block is word-aligned (blocks are whole words from an aligned page), so an alignment
//! up to 8 needs nothing but `mi_malloc`; larger ones still go to `mi_malloc_aligned`.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment every mimalloc block has: one machine word.
const WORD_ALIGN: usize = std::mem::size_of::<usize>();

/// Whether any mimalloc block serves `layout`, so the plain functions do (see the module docs).
fn word_aligned(layout: Layout) -> bool {
    layout.align() <= WORD_ALIGN
}

/// A new block for `layout`: from `plain` where any block serves it, else from `aligned`.
///
/// # Safety
/// `plain` and `aligned` are mimalloc's allocation functions of one kind (plain or zeroed).
#[inline]
unsafe fn allocate(
    layout: Layout,
    plain: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    // SAFETY: mimalloc's allocation functions accept any size, zero included.
    unsafe {
        if word_aligned(layout) {
            plain(layout.size()).cast()
        } else {
            aligned(layout.size(), layout.align()).cast()
        }
    }
}

/// mimalloc as the global allocator (see the module documentation).
pub struct Mimalloc;

// SAFETY: each method hands mimalloc's result straight back; mimalloc returns null on failure
// (as GlobalAlloc asks) and blocks aligned as requested: to a word by the plain functions, which
// is all a word-aligned layout needs, and to `align` by the `_aligned` forms otherwise.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: two allocation functions of mimalloc's.
        unsafe { allocate(layout, mi::mi_malloc, mi::mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: two allocation functions of mimalloc's.
        unsafe { allocate(layout, mi::mi_zalloc, mi::mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: GlobalAlloc's contract: `ptr` came from this allocator, i.e. from mimalloc,
        // whose `mi_free` takes blocks from every one of its allocation functions.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from mimalloc (GlobalAlloc's contract); the new block keeps the
        // layout's alignment as `alloc` would give it.
        unsafe {
            if word_aligned(layout) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size class from a byte to past mimalloc's small and medium blocks, at every
    /// alignment from 1 to a page: each block aligned as asked, writable over its whole size,
    /// grown and shrunk with its bytes kept.
    #[test]
    fn blocks_are_aligned_and_keep_their_bytes() {
        let sizes = (0..12)
            .flat_map(|shift| {
                let base = 1usize << shift;
                [base, base + 1, base * 3 / 2 + 8]
            })
            .chain([1000, 1025, 1500, 4097, 70_000, 600_000, 2 << 20]);
        for size in sizes {
            for align in (0..13).map(|s| 1usize << s) {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: the layout is valid and nonzero-sized; each block is freed once.
                unsafe {
                    let p = Mimalloc.alloc(layout);
                    assert!(!p.is_null(), "{size} bytes at {align}");
                    assert_eq!(p as usize % align, 0, "{size} bytes at {align}");
                    for i in 0..size {
                        p.add(i).write(i as u8);
                    }
                    let bigger = size * 2 + 100;
                    let q = Mimalloc.realloc(p, layout, bigger);
                    assert_eq!(q as usize % align, 0, "grown {size} bytes at {align}");
                    assert!((0..size).all(|i| q.add(i).read() == i as u8));
                    let smaller = (size / 2).max(1);
                    let r = Mimalloc.realloc(
                        q,
                        Layout::from_size_align(bigger, align).unwrap(),
                        smaller,
                    );
                    assert_eq!(r as usize % align, 0, "shrunk {size} bytes at {align}");
                    assert!((0..smaller).all(|i| r.add(i).read() == i as u8));
                    Mimalloc.dealloc(r, Layout::from_size_align(smaller, align).unwrap());

                    let z = Mimalloc.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zeroed {size} bytes at {align}");
                    assert!((0..size).all(|i| z.add(i).read() == 0));
                    Mimalloc.dealloc(z, layout);
                }
            }
        }
    }
}
