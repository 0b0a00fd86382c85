//! The C types of `include/bulk_transfer/*.h`, field for field. Enum-typed
//! fields are `u32` here: a C program can store any value in them, so the
//! library reads them as numbers and checks them (see [`crate::codes`]).
//! The layout test in `layout.rs` compares these with what a C compiler
//! makes of the headers.

use std::ffi::{c_char, c_void};

/// `errval_t`.
pub type Errval = usize;

/// `struct bulk_continuation`'s handler.
pub type ContHandler = unsafe extern "C" fn(arg: *mut c_void, err: Errval, channel: *mut BulkChannel);

/// `struct bulk_continuation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkContinuation {
    /// Called with `arg`, the error and the channel; NULL: nothing runs.
    pub handler: Option<ContHandler>,
    /// The program's argument.
    pub arg: *mut c_void,
}

/// `struct bulk_endpoint_descriptor`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkEndpointDescriptor {
    /// [`crate::codes::EP_MAGIC`] once initialized by the library.
    pub magic: u32,
    /// `enum bulk_backend`.
    pub backend: u32,
    /// Nonzero: names an endpoint to bind to.
    pub remote: u32,
    /// Unused.
    pub reserved: u32,
}

/// `struct bulk_local_endpoint`.
#[repr(C)]
pub struct BulkLocalEndpoint {
    /// The generic part.
    pub generic: BulkEndpointDescriptor,
    /// NULL to create; the created channel to bind to.
    pub other_channel: *mut BulkChannel,
}

/// Capacity of [`BulkSmEndpointDescriptor::path`] (`BULK_SM_PATH_MAX + 1`).
pub const SM_PATH_CAP: usize = 108;

/// `struct bulk_sm_endpoint_descriptor`.
#[repr(C)]
pub struct BulkSmEndpointDescriptor {
    /// The generic part.
    pub ep_generic: BulkEndpointDescriptor,
    /// The Unix socket path, NUL-terminated.
    pub path: [c_char; SM_PATH_CAP],
}

/// Capacity of [`BulkNetEndpointDescriptor::ip`] (`BULK_NET_IP_MAX + 1`).
pub const NET_IP_CAP: usize = 46;

/// `struct bulk_net_ep_setup`.
#[repr(C)]
pub struct BulkNetEpSetup {
    /// The address as text.
    pub ip: *const c_char,
    /// The port.
    pub port: u16,
}

/// `struct bulk_net_endpoint_descriptor`.
#[repr(C)]
pub struct BulkNetEndpointDescriptor {
    /// The generic part.
    pub ep_generic: BulkEndpointDescriptor,
    /// The address, NUL-terminated.
    pub ip: [c_char; NET_IP_CAP],
    /// The port.
    pub port: u16,
}

/// `struct bulk_channel_constraints`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkChannelConstraints {
    /// Recorded only.
    pub mem_range_min: usize,
    /// Recorded only.
    pub mem_range_max: usize,
    /// Alignment of buffers (the original's spelling).
    pub men_align: usize,
}

/// `struct bulk_channel_callbacks`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkChannelCallbacks {
    /// Creator: bound.
    pub bind_received: Option<unsafe extern "C" fn(*mut BulkChannel) -> Errval>,
    /// The peer went away.
    pub teardown_received: Option<unsafe extern "C" fn(*mut BulkChannel)>,
    /// The peer assigns a pool; nonzero vetoes.
    pub pool_assigned: Option<unsafe extern "C" fn(*mut BulkChannel, *mut BulkPool) -> Errval>,
    /// The peer removed a pool.
    pub pool_removed: Option<unsafe extern "C" fn(*mut BulkChannel, *mut BulkPool) -> Errval>,
    /// A buffer moved to us.
    pub move_received: Option<BufferCallback>,
    /// A buffer passed back to us.
    pub buffer_received: Option<BufferCallback>,
    /// A copy arrived.
    pub copy_received: Option<BufferCallback>,
    /// A copy came back.
    pub copy_released: Option<unsafe extern "C" fn(*mut BulkChannel, *mut BulkBuffer)>,
    /// Never called.
    pub request_received: Option<unsafe extern "C" fn(*mut BulkChannel, usize)>,
}

/// The callbacks that hand over a buffer with its meta data.
pub type BufferCallback = unsafe extern "C" fn(*mut BulkChannel, *mut BulkBuffer, *mut c_void);

/// `struct bulk_channel`.
#[repr(C)]
pub struct BulkChannel {
    /// The program's callbacks.
    pub callbacks: *mut BulkChannelCallbacks,
    /// The endpoint.
    pub ep: *mut BulkEndpointDescriptor,
    /// `enum bulk_channel_state`.
    pub state: u32,
    /// Always NULL.
    pub pools: *mut c_void,
    /// `enum bulk_channel_direction`.
    pub direction: u32,
    /// `enum bulk_channel_role`.
    pub role: u32,
    /// `enum bulk_trust_level`.
    pub trust: u32,
    /// As given.
    pub constraints: BulkChannelConstraints,
    /// Meta data bytes per transfer.
    pub meta_size: usize,
    /// `struct waitset *`.
    pub waitset: *mut c_void,
    /// The program's.
    pub user_state: *mut c_void,
    /// The library's token for the channel.
    pub impl_data: *mut c_void,
}

/// `struct bulk_channel_setup`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkChannelSetup {
    /// `enum bulk_channel_direction`.
    pub direction: u32,
    /// `enum bulk_channel_role`.
    pub role: u32,
    /// `enum bulk_trust_level`.
    pub trust: u32,
    /// Constraints.
    pub constraints: BulkChannelConstraints,
    /// Meta data bytes per transfer.
    pub meta_size: usize,
    /// NULL: the default waitset.
    pub waitset: *mut c_void,
    /// Copied to the channel.
    pub user_state: *mut c_void,
}

/// `struct bulk_channel_bind_params`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkChannelBindParams {
    /// `enum bulk_channel_role`.
    pub role: u32,
    /// `enum bulk_trust_level`.
    pub trust: u32,
    /// Constraints.
    pub constraints: BulkChannelConstraints,
    /// NULL: the default waitset.
    pub waitset: *mut c_void,
    /// Copied to the channel.
    pub user_state: *mut c_void,
}

/// `struct bulk_pool_id`.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct BulkPoolId {
    /// Bits 127..96 of the pool id.
    pub machine: u32,
    /// Bits 95..64.
    pub dom: u32,
    /// Bits 63..32.
    pub local: u32,
    /// Bits 31..0.
    pub tag: u32,
}

/// `struct bulk_pool`.
#[repr(C)]
pub struct BulkPool {
    /// The id.
    pub id: BulkPoolId,
    /// Mapping address in this process.
    pub base_address: usize,
    /// Bytes per buffer.
    pub buffer_size: usize,
    /// `enum bulk_trust_level`.
    pub trust: u32,
    /// Buffers in the pool.
    pub num_buffers: usize,
    /// Pointers to the buffers, by index.
    pub buffers: *mut *mut BulkBuffer,
}

/// `struct bulk_buffer`.
#[repr(C)]
pub struct BulkBuffer {
    /// Where the buffer is mapped in this process.
    pub address: *mut c_void,
    /// Its pool.
    pub pool: *mut BulkPool,
    /// Index in the pool.
    pub bufferid: u32,
    /// `enum bulk_buffer_state`.
    pub state: u32,
    /// Copies held by the program.
    pub local_ref_count: u32,
    /// Unused.
    pub reserved: u32,
}

/// `struct bulk_allocator`.
#[repr(C)]
pub struct BulkAllocator {
    /// The pool.
    pub pool: *mut BulkPool,
    /// Free buffers.
    pub num_free: usize,
    /// The library's token for the allocator.
    pub impl_data: *mut c_void,
}

/// `struct bulk_pool_constraints`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkPoolConstraints {
    /// Recorded only.
    pub range_min: usize,
    /// Recorded only.
    pub range_max: usize,
    /// Buffer alignment (0: a page).
    pub alignment: usize,
    /// `enum bulk_trust_level`.
    pub trust: u32,
}
