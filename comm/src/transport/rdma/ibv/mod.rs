//! The verbs provider (feature `rdma`): the host's verbs devices through the raw verbs of the
//! ibverbs crate (`ibverbs-sys`, whose safe layer posts only sends on port 1 and cannot write
//! with immediate or register memory it did not allocate).
//!
//! - this file: [`Nic`], one opened port (its context, protection domain and addressing), and
//!   [`open`], which lists the devices, takes the first active port `OXCCL_IB_HCA` allows and
//!   its GID (`OXCCL_IB_GID_INDEX`, else [`super::address::choose_gid`]'s rule);
//! - [`qp`]: [`qp::VerbsQp`], a reliable-connected queue pair with its completion queue and
//!   registered regions, implementing [`super::verbs::QueuePair`];
//! - [`side`]: a rank's queue pairs of one communicator, from creation to ready-to-send
//!   through the store.
//!
//! Every call here is FFI into libibverbs; each `unsafe` block says what it relies on.

pub(crate) mod qp;
pub(crate) mod side;

use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use ibverbs_sys as ffi;

use super::address::{choose_gid, choose_hcas, Device, GidEntry, LinkLayer};

/// One opened port of a verbs device, shared by the queue pairs and regions made on it (see the
/// module docs).
pub(crate) struct Nic {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    /// The device's name (`mlx5_0`).
    pub name: String,
    /// The port number.
    pub port: u8,
    /// InfiniBand or Ethernet (RoCE).
    pub link: LinkLayer,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// The GID index used.
    pub gid_index: u32,
    /// The GID at that index.
    pub gid: [u8; 16],
    /// The port's active MTU in bytes.
    pub mtu: u32,
    /// The port takes only addresses with a global route header (`IBV_QPF_GRH_REQUIRED`).
    pub grh_required: bool,
}

/// `IBV_QPF_GRH_REQUIRED` of `ibv_port_attr.flags` (verbs.h's `enum ibv_port_attr_flags`).
const QPF_GRH_REQUIRED: u8 = 1;

// SAFETY: libibverbs objects may be used from any thread (rdma-core's verbs are thread-safe);
// `Nic` only hands its pointers to verbs calls and frees them once, in `drop`.
unsafe impl Send for Nic {}
// SAFETY: as above; nothing in `Nic` is mutated after `open`.
unsafe impl Sync for Nic {}

impl Nic {
    /// `mlx5_0:1`, as `OXCCL_IB_HCA` names it.
    pub(crate) fn port_name(&self) -> String {
        format!("{}:{}", self.name, self.port)
    }

    pub(crate) fn ctx(&self) -> *mut ffi::ibv_context {
        self.ctx
    }

    pub(crate) fn pd(&self) -> *mut ffi::ibv_pd {
        self.pd
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        // SAFETY: `pd` and `ctx` came from ibv_alloc_pd / ibv_open_device in `open`, are freed
        // only here, and every queue pair and region made on them holds an `Arc<Nic>`, so none
        // outlives them.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// The device list, freed on drop.
struct DeviceList {
    list: *mut *mut ffi::ibv_device,
    n: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, String> {
        let mut n = 0i32;
        // SAFETY: ibv_get_device_list writes the count into `n` and returns a list to free
        // with ibv_free_device_list (done in `drop`), or null with errno set.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            // ENOSYS: no /sys/class/infiniband.
            return Err(match e.kind() {
                std::io::ErrorKind::Unsupported => {
                    format!("no verbs device: the kernel has no RDMA support (ibv_get_device_list: {e})")
                }
                _ => format!("ibv_get_device_list failed: {e}"),
            });
        }
        Ok(DeviceList {
            list,
            n: n.max(0) as usize,
        })
    }

    fn devices(&self) -> &[*mut ffi::ibv_device] {
        // SAFETY: the list holds `n` device pointers (ibv_get_device_list's contract) and lives
        // until `self` drops.
        unsafe { std::slice::from_raw_parts(self.list, self.n) }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(self.list) }
    }
}

/// An opened device context, closed on drop unless kept.
struct Ctx(*mut ffi::ibv_context);

impl Ctx {
    fn open(dev: *mut ffi::ibv_device) -> Option<Ctx> {
        // SAFETY: `dev` is an entry of a live device list.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        (!ctx.is_null()).then_some(Ctx(ctx))
    }

    fn ports(&self) -> u8 {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: `self.0` is an open context and `attr` a writable ibv_device_attr.
        let rc = unsafe { ffi::ibv_query_device(self.0, &mut attr) };
        if rc == 0 {
            attr.phys_port_cnt
        } else {
            0
        }
    }

    fn port(&self, port: u8) -> Option<ffi::ibv_port_attr> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `self.0` is an open context and `attr` a writable ibv_port_attr; the exported
        // (compat) ibv_query_port writes its leading part, which holds every field used here
        // (state, MTUs, LID, link layer, flags), and leaves the rest zero.
        let rc = unsafe { ffi::ibv_query_port(self.0, port, (&raw mut attr).cast()) };
        (rc == 0).then_some(attr)
    }

    /// The GID table of `port`, or why it cannot be read.
    fn gids(&self, port: u8) -> Result<Vec<GidEntry>, String> {
        // Room for every port's entries, as the call requires.
        let room: usize = (1..=self.ports())
            .filter_map(|p| self.port(p))
            .map(|a| a.gid_tbl_len.max(0) as usize)
            .sum();
        let mut table = vec![ffi::ibv_gid_entry::default(); room.max(1)];
        // SAFETY: `table` has room for `table.len()` entries of the size passed; the call
        // writes at most that many and returns how many (negative: an error).
        let n = unsafe {
            ffi::_ibv_query_gid_table(
                self.0,
                table.as_mut_ptr(),
                table.len(),
                0,
                std::mem::size_of::<ffi::ibv_gid_entry>(),
            )
        };
        if n < 0 {
            return Err(format!(
                "ibv_query_gid_table: {}",
                std::io::Error::from_raw_os_error(-n as i32)
            ));
        }
        table.truncate(n as usize);
        Ok(table
            .into_iter()
            .filter(|e| e.port_num == u32::from(port))
            .map(|e| GidEntry {
                index: e.gid_index,
                // SAFETY: both members of the union are plain bytes of the same 16.
                gid: unsafe { e.gid.raw },
                roce_v2: e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2,
            })
            .collect())
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: an open context, closed once (`keep` nulls it when a `Nic` takes it).
            unsafe { ffi::ibv_close_device(self.0) };
        }
    }
}

fn name_of(dev: *mut ffi::ibv_device) -> String {
    // SAFETY: `dev` is an entry of a live device list; its name is a C string it owns.
    let p = unsafe { ffi::ibv_get_device_name(dev) };
    if p.is_null() {
        return "?".into();
    }
    // SAFETY: non-null, NUL-terminated, alive as long as the list.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn mtu_bytes(m: ffi::ibv_mtu) -> u32 {
    if (1..=5).contains(&m) {
        128 << m
    } else {
        0
    }
}

/// The port this rank would use: `OXCCL_IB_HCA`'s first active (device, port), opened; or why
/// there is none (no device, none active, none matching, the GID rule failing).
pub(crate) fn open(hca: Option<&str>, gid_index: Option<u32>) -> Result<Arc<Nic>, String> {
    // One `Nic` per process and setting while any communicator holds it.
    type Cache = Mutex<Vec<((Option<String>, Option<u32>), Weak<Nic>)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let key = (hca.map(str::to_string), gid_index);
    let mut cache = CACHE
        .get_or_init(Cache::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    cache.retain(|(_, w)| w.strong_count() > 0);
    if let Some(nic) = cache
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(nic);
    }
    let nic = Arc::new(open_uncached(hca, gid_index)?);
    cache.push((key, Arc::downgrade(&nic)));
    Ok(nic)
}

fn open_uncached(hca: Option<&str>, gid_index: Option<u32>) -> Result<Nic, String> {
    let list = DeviceList::get()?;
    if list.devices().is_empty() {
        return Err("no verbs device (ibv_get_device_list lists none)".into());
    }
    let mut seen = Vec::new();
    for &dev in list.devices() {
        let Some(ctx) = Ctx::open(dev) else { continue };
        // InfiniBand and RoCE devices only: iWARP and EFA have no RC queue pairs of this kind.
        // SAFETY: `dev` is an entry of a live device list.
        let ib = unsafe { (*dev).transport_type } == ffi::IBV_TRANSPORT_IB;
        let ports = (1..=ctx.ports())
            .map(|p| {
                let active = ctx
                    .port(p)
                    .is_some_and(|a| a.state == ffi::ibv_port_state::IBV_PORT_ACTIVE);
                (p, ib && active)
            })
            .collect();
        seen.push(Device {
            name: name_of(dev),
            ports,
        });
    }
    let chosen = choose_hcas(&seen, hca)?;
    let Some((name, port)) = chosen.first().cloned() else {
        return Err(format!(
            "no active port{}: devices {:?}",
            hca.map_or_else(String::new, |h| format!(" matches OXCCL_IB_HCA={h}")),
            seen
        ));
    };
    let dev = list
        .devices()
        .iter()
        .copied()
        .find(|&d| name_of(d) == name)
        .ok_or_else(|| format!("device {name} left the list"))?;
    let mut ctx = Ctx::open(dev).ok_or_else(|| format!("cannot open {name}"))?;
    let attr = ctx
        .port(port)
        .ok_or_else(|| format!("cannot query {name}:{port}"))?;
    let link = if u32::from(attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET {
        LinkLayer::Ethernet
    } else {
        LinkLayer::InfiniBand
    };
    let table = ctx.gids(port).map_err(|e| format!("{name}:{port}: {e}"))?;
    let index = choose_gid(&table, gid_index).map_err(|e| format!("{name}:{port}: {e}"))?;
    let gid = table
        .iter()
        .find(|e| e.index == index)
        .map_or([0; 16], |e| e.gid);
    // SAFETY: an open context.
    let pd = unsafe { ffi::ibv_alloc_pd(ctx.0) };
    if pd.is_null() {
        return Err(format!(
            "{name}:{port}: ibv_alloc_pd failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let raw = std::mem::replace(&mut ctx.0, std::ptr::null_mut());
    Ok(Nic {
        ctx: raw,
        pd,
        name,
        port,
        link,
        lid: attr.lid,
        gid_index: index,
        gid,
        mtu: mtu_bytes(attr.active_mtu),
        grh_required: attr.flags & QPF_GRH_REQUIRED != 0,
    })
}
