// SPDX-License-Identifier: MIT OR Apache-2.0
//! The C ABI called from Rust: status mapping, handle ownership and sets.

use std::ffi::CString;
use std::ptr::null_mut;

use nrt::*;
use tdrv::compat::TensorCompat;

fn alloc(size: usize, name: &str) -> *mut nrt_tensor_t {
    let name = CString::new(name).unwrap();
    let mut t = null_mut();
    // SAFETY: valid name and out pointer.
    let s = unsafe {
        nrt_tensor_allocate(
            NRT_TENSOR_PLACEMENT_VIRTUAL,
            -1,
            size,
            name.as_ptr(),
            &mut t,
        )
    };
    assert_eq!(s, NRT_SUCCESS);
    t
}

#[test]
fn status_mapping() {
    use tdrv::{Error, SysError};
    assert_eq!(
        status_of(&Error::Timeout {
            op: "x",
            name: String::new(),
            waited: std::time::Duration::ZERO
        }),
        NRT_TIMEOUT
    );
    assert_eq!(
        status_of(&Error::CrossChannel { src: 0, dst: 1 }),
        NRT_INVALID
    );
    assert_eq!(
        status_of(&Error::Sys(SysError::from_errno("COPY", libc::EXDEV))),
        NRT_INVALID
    );
    assert_eq!(
        status_of(&Error::Sys(SysError::from_errno("ALLOC", libc::ENOSPC))),
        NRT_RESOURCE
    );
    assert_eq!(
        status_of(&Error::Sys(SysError::from_errno("WAIT", libc::ETIMEDOUT))),
        NRT_TIMEOUT
    );
    // Host memory is not the device's: libnrt's own status for it.
    assert_eq!(status_of(&Error::OutOfMemory(1)), NRT_FAIL_HOST_MEM_ALLOC);
    // A refused device allocation keeps the driver's status.
    assert_eq!(
        status_of(&Error::DeviceAlloc {
            device: "/dev/tdrv0".into(),
            channel: 0,
            size: 64,
            source: SysError::NoSpace { op: "ALLOC" },
        }),
        NRT_RESOURCE
    );
}

#[test]
#[cfg_attr(miri, ignore = "runs itself in a child process")]
fn device_placement_without_a_device_fails_cleanly() {
    // libnrt reads TDRV_DEVICE once per process, and the host may have a
    // tdrv node: the check runs in a child process of this test binary
    // whose TDRV_DEVICE names no node, whatever this machine has.
    const NAME: &str = "device_placement_without_a_device_fails_cleanly";
    if std::env::var_os("NRT_ABI_TEST_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--test-threads=1"])
            .env("NRT_ABI_TEST_CHILD", "1")
            .env("TDRV_DEVICE", "/nonexistent/tdrv9")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "the child run of {NAME}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let mut t = null_mut();
    // SAFETY: valid out pointer, NULL name.
    let s = unsafe {
        nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, 64, std::ptr::null(), &mut t)
    };
    assert_eq!(s, NRT_UNINITIALIZED);
    assert!(t.is_null());
}

#[test]
fn impossible_host_allocation_is_nrt_fail_host_mem_alloc() {
    let mut t = null_mut();
    // SAFETY: valid out pointer, NULL name.
    let s = unsafe {
        nrt_tensor_allocate(
            NRT_TENSOR_PLACEMENT_HOST,
            0,
            usize::MAX / 2,
            std::ptr::null(),
            &mut t,
        )
    };
    assert_eq!(s, NRT_FAIL_HOST_MEM_ALLOC);
    assert!(t.is_null());
}

#[test]
fn a_set_keeps_its_tensors_alive() {
    let mut t = alloc(32, "kept");
    let mut set = null_mut();
    let name = CString::new("k").unwrap();
    // SAFETY: valid pointers throughout; `t` is a live handle until freed.
    unsafe {
        assert_eq!(nrt_allocate_tensor_set(&mut set), NRT_SUCCESS);
        assert_eq!(
            nrt_tensor_write(t, [9u8; 32].as_ptr().cast(), 0, 32),
            NRT_SUCCESS
        );
        assert_eq!(
            nrt_add_tensor_to_tensor_set(set, name.as_ptr(), t),
            NRT_SUCCESS
        );
        // Attaching to a tensor in a set is refused.
        let mut buf = [0u8; 4];
        assert_eq!(
            nrt_tensor_attach_buffer(t, buf.as_mut_ptr().cast(), 4),
            NRT_INVALID
        );
        nrt_tensor_free(&mut t);
        assert!(t.is_null());
        let mut got = null_mut();
        assert_eq!(
            nrt_get_tensor_from_tensor_set(set, name.as_ptr(), &mut got),
            NRT_SUCCESS
        );
        let mut back = [0u8; 32];
        assert_eq!(
            nrt_tensor_read(got, back.as_mut_ptr().cast(), 0, 32),
            NRT_SUCCESS
        );
        assert_eq!(back, [9; 32]);
        assert_eq!(nrt_tensor_get_size(got), 32);
        nrt_destroy_tensor_set(&mut set);
        assert!(set.is_null());
    }
}

#[test]
fn the_nrt_cleanup_pattern_frees_through_the_set() {
    // Programs often free their tensors by fetching them from the set.
    let t = alloc(8, "t");
    let mut set = null_mut();
    let name = CString::new("t").unwrap();
    // SAFETY: valid pointers; the caller's reference is released once.
    unsafe {
        nrt_allocate_tensor_set(&mut set);
        nrt_add_tensor_to_tensor_set(set, name.as_ptr(), t);
        let mut got = null_mut();
        nrt_get_tensor_from_tensor_set(set, name.as_ptr(), &mut got);
        assert_eq!(got, t);
        nrt_tensor_free(&mut got);
        nrt_destroy_tensor_set(&mut set);
    }
}

#[test]
fn attach_replaces_allocated_storage_in_place() {
    let t = alloc(64, "a");
    let mut buf = vec![0u8; 16];
    // SAFETY: `buf` outlives the tensor, which is freed below.
    unsafe {
        assert_eq!(
            nrt_tensor_attach_buffer(t, buf.as_mut_ptr().cast(), 16),
            NRT_SUCCESS
        );
        assert_eq!(nrt_tensor_get_size(t), 16);
        assert_eq!(nrt_tensor_get_va(t), buf.as_mut_ptr().cast());
        assert_eq!(nrt_tensor_memset(t, 0, 7, 16), NRT_SUCCESS);
        // A NULL buffer with a size is refused.
        assert_eq!(nrt_tensor_attach_buffer(t, null_mut(), 4), NRT_INVALID);
        let mut t = t;
        nrt_tensor_free(&mut t);
    }
    assert_eq!(buf, vec![7; 16]);
}

#[test]
fn host_completion_through_the_c_abi() {
    let t = alloc(8, "out");
    // SAFETY: live handle.
    unsafe {
        assert_eq!(nrt_tensor_check_output_completion(t, 0, 0), NRT_SUCCESS);
        assert_eq!(nrt_tensor_check_output_completion(t, 1000, 1), NRT_TIMEOUT);
        let tensor = tensor_from_handle(t).unwrap();
        tensor.record_output_completion().unwrap();
        assert_eq!(nrt_tensor_check_output_completion(t, -1, 1), NRT_SUCCESS);
        assert_eq!(nrt_tensor_reset_output_completion(t), NRT_SUCCESS);
        assert_eq!(nrt_tensor_check_output_completion(t, 0, 1), NRT_TIMEOUT);
        let mut t = t;
        nrt_tensor_free(&mut t);
    }
}

#[test]
fn dmabuf_fd_of_host_memory_and_bad_arguments_are_invalid() {
    let t = alloc(4096, "host");
    let va = nrt_tensor_get_va(t) as u64;
    assert_ne!(va, 0);
    let mut fd = -1;
    // SAFETY: `fd` is writable.
    assert_eq!(unsafe { nrt_get_dmabuf_fd(va, 16, &mut fd) }, NRT_INVALID);
    assert_eq!(fd, -1);
    // SAFETY: as above; NULL is allowed and refused.
    unsafe {
        assert_eq!(nrt_get_dmabuf_fd(va, 0, &mut fd), NRT_INVALID);
        assert_eq!(nrt_get_dmabuf_fd(va, 16, std::ptr::null_mut()), NRT_INVALID);
        assert_eq!(nrt_get_dmabuf_fd(u64::MAX, 2, &mut fd), NRT_INVALID);
    }
    let mut t = t;
    // SAFETY: a live handle variable.
    unsafe { nrt_tensor_free(&mut t) };
}

#[test]
fn memcpy_to_device_refuses_host_memory_and_bad_arguments() {
    let t = alloc(4096, "host");
    let va = nrt_tensor_get_va(t);
    let src = [7u8; 16];
    // SAFETY: `src` is readable for 16 bytes; `dest` is only looked up.
    unsafe {
        assert_eq!(
            nrt_memcpy_to_device(va, src.as_ptr().cast(), 16),
            NRT_INVALID
        );
        assert_eq!(nrt_memcpy_to_device(va, std::ptr::null(), 16), NRT_INVALID);
        assert_eq!(
            nrt_memcpy_to_device(null_mut(), src.as_ptr().cast(), 16),
            NRT_INVALID
        );
        assert_eq!(
            nrt_memcpy_to_device(null_mut(), std::ptr::null(), 0),
            NRT_SUCCESS
        );
    }
    // Host memory was not written.
    let mut back = [1u8; 16];
    // SAFETY: live handle, writable buffer.
    assert_eq!(
        unsafe { nrt_tensor_read(t, back.as_mut_ptr().cast(), 0, 16) },
        NRT_SUCCESS
    );
    assert_eq!(back, [0u8; 16]);
    // SAFETY: NULL is allowed and refused.
    assert_eq!(unsafe { nrt_get_total_nc_count(null_mut()) }, NRT_INVALID);
    let mut t = t;
    // SAFETY: a live handle variable.
    unsafe { nrt_tensor_free(&mut t) };
}
