//! Pause / resume over a device's engines (issue #17, user-facing part): the current
//! tag of every engine ([`Core::set_tag`]), and [`Core::pause`] / [`Core::resume`] of one
//! device's default engine and private pools together, all or nothing. The engine does
//! the work (`stweaver_core::engine::pause`): addresses stay reserved, the physical
//! memory goes back to the device (and out of its [`DeviceBudget`]), contents are kept
//! on the host when asked.
//!
//! Tags: 0 is untagged (never paused); [`Core::set_tag`] reaches every engine open now
//! and is remembered for engines opened later. In [`Core::pause`] and [`Core::resume`],
//! tag 0 means every tagged block (the engine's `None` key).
//!
//! [`DeviceBudget`]: crate::tracked::DeviceBudget

use std::sync::atomic::Ordering;

use stweaver_core::engine::{Engine, EngineError, HostBackup, PauseError, PauseReport};
use stweaver_core::units::Bytes;

use super::{Core, DeviceSlot, read};
use crate::error::{BridgeError, Result};
use crate::tracked::Tracked;

/// A device's pause key from the bridge's tag (0: every tagged block).
fn key(tag: u32) -> Option<u32> {
    (tag != 0).then_some(tag)
}

fn add(a: &mut PauseReport, b: PauseReport) {
    a.blocks += b.blocks;
    a.units += b.units;
    a.bytes = Bytes(a.bytes.get() + b.bytes.get());
    a.copied = Bytes(a.copied.get() + b.copied.get());
    a.pinned = Bytes(a.pinned.get() + b.pinned.get());
    a.fallbacks += b.fallbacks;
    a.host_allocs += b.host_allocs;
}

/// Calls `f` on every engine of `slot`: its default engine (once opened), then its private
/// pools'.
fn each_engine(slot: &DeviceSlot, mut f: impl FnMut(&Engine<Tracked>) -> Result<()>) -> Result<()> {
    let private = read(&slot.private);
    for e in slot
        .default
        .get()
        .into_iter()
        .chain(private.values().map(|p| &p.engine))
    {
        f(e)?;
    }
    Ok(())
}

/// Whether `engine` holds a pause that `resume(key)` resumes.
fn holds(engine: &Engine<Tracked>, key: Option<u32>) -> Result<bool> {
    let tags = engine.paused_tags()?;
    Ok(match key {
        None => !tags.is_empty(),
        Some(_) => tags.contains(&key),
    })
}

impl Core {
    /// The tag allocations get from now on, on every engine of every device (0:
    /// untagged); engines opened later start with it.
    pub fn set_tag(&self, tag: u32) -> Result<()> {
        self.tag.store(tag, Ordering::SeqCst);
        let Some(slots) = self.devices.get() else {
            return Ok(());
        };
        for slot in slots {
            if let Some(e) = slot.default.get() {
                e.set_tag(tag)?;
            }
            for p in read(&slot.private).values() {
                p.engine.set_tag(tag)?;
            }
        }
        Ok(())
    }

    /// The tag allocations get now.
    pub fn tag(&self) -> u32 {
        self.tag.load(Ordering::SeqCst)
    }

    /// Pauses the blocks of `tag` (0: every tagged block) in every engine of `device`
    /// (the default pool, opened now if it was not, and each private pool), keeping their
    /// contents on the host when `keep`. All or nothing: when one engine refuses, the
    /// engines paused by this call are resumed and its error is returned.
    pub fn pause(&self, device: i32, tag: u32, keep: bool) -> Result<PauseReport> {
        let slot = self.slot(device)?;
        let key = key(tag);
        let default = self.default_engine(slot)?;
        // Held for the whole pause: no private pool appears or retires meanwhile.
        let private = read(&slot.private);
        let engines: Vec<&Engine<Tracked>> = std::iter::once(default)
            .chain(private.values().map(|p| &p.engine))
            .collect();
        let mut total = PauseReport::default();
        for (k, e) in engines.iter().enumerate() {
            match e.pause(key, keep) {
                Ok(r) => add(&mut total, r),
                Err(err) => {
                    // The failing engine may have recorded a partial pause (a failed
                    // unmap): undo it with the others.
                    // Its own pause of the key, if it refused as already paused, stays.
                    let own = !matches!(err, EngineError::Pause(PauseError::AlreadyPaused(_)));
                    let mut undo = Vec::new();
                    let touched = if own { &engines[..=k] } else { &engines[..k] };
                    for done in touched {
                        if holds(done, key)?
                            && let Err(u) = done.resume(key)
                        {
                            undo.push(u.to_string());
                        }
                    }
                    return Err(rolled_back(device, err, undo));
                }
            }
        }
        drop(private);
        self.after_op(slot)?;
        Ok(total)
    }

    /// Resumes the pause of `tag` (0: every pause in force) on `device`: the same
    /// addresses, fresh memory, the saved contents. When one engine refuses (the
    /// device's memory is taken meanwhile: out of memory), the engines resumed by this
    /// call are paused again (contents kept) and its error is returned.
    pub fn resume(&self, device: i32, tag: u32) -> Result<PauseReport> {
        let slot = self.slot(device)?;
        let key = key(tag);
        let Some(default) = slot.default.get() else {
            return Err(EngineError::from(PauseError::NotPaused(key)).into());
        };
        let private = read(&slot.private);
        let mut engines: Vec<&Engine<Tracked>> = Vec::new();
        for e in std::iter::once(default).chain(private.values().map(|p| &p.engine)) {
            if holds(e, key)? {
                engines.push(e);
            }
        }
        if engines.is_empty() {
            return Err(EngineError::from(PauseError::NotPaused(key)).into());
        }
        let mut total = PauseReport::default();
        for (k, e) in engines.iter().enumerate() {
            match e.resume(key) {
                Ok(r) => add(&mut total, r),
                Err(err) => {
                    let undo = engines[..k]
                        .iter()
                        .filter_map(|done| done.pause(key, true).err())
                        .map(|u| u.to_string())
                        .collect();
                    return Err(rolled_back(device, err, undo));
                }
            }
        }
        drop(private);
        self.after_op(slot)?;
        Ok(total)
    }

    /// Bytes of `device` whose physical memory is paused now, over all its engines.
    pub fn paused_bytes(&self, device: i32) -> Result<u64> {
        self.slot_paused(self.slot(device)?).map(|(bytes, _)| bytes)
    }

    /// The host memory `device`'s engines hold for kept contents (in use by paused sets,
    /// cached for the next pause of their key), summed.
    pub fn host_backup(&self, device: i32) -> Result<HostBackup> {
        self.slot_host_backup(self.slot(device)?)
    }

    /// Frees the host buffers `device`'s engines cache for the next pause (those of
    /// paused sets stay). Returns the bytes freed.
    pub fn release_host_buffers(&self, device: i32) -> Result<u64> {
        let mut freed = 0;
        each_engine(self.slot(device)?, |e| {
            freed += e.release_host_buffers()?.get();
            Ok(())
        })?;
        Ok(freed)
    }

    pub(super) fn slot_host_backup(&self, slot: &DeviceSlot) -> Result<HostBackup> {
        let mut out = HostBackup::default();
        each_engine(slot, |e| {
            let h = e.host_backup()?;
            out.in_use = Bytes(out.in_use.get() + h.in_use.get());
            out.cached = Bytes(out.cached.get() + h.cached.get());
            out.pinned = Bytes(out.pinned.get() + h.pinned.get());
            out.allocations += h.allocations;
            out.fallbacks += h.fallbacks;
            Ok(())
        })?;
        Ok(out)
    }

    /// The paused bytes and keys (0: every tag, as [`Core::pause`] takes them; sorted,
    /// once each) of `slot`'s engines.
    pub(super) fn slot_paused(&self, slot: &DeviceSlot) -> Result<(u64, Vec<u32>)> {
        let mut bytes = 0;
        let mut tags = Vec::new();
        each_engine(slot, |e| {
            bytes += e.paused_bytes()?.get();
            tags.extend(e.paused_tags()?.into_iter().map(|k| k.unwrap_or(0)));
            Ok(())
        })?;
        tags.sort_unstable();
        tags.dedup();
        Ok((bytes, tags))
    }
}

/// The error of a refused pause or resume, with what undoing the other engines hit.
fn rolled_back(device: i32, error: EngineError, undo: Vec<String>) -> BridgeError {
    if undo.is_empty() {
        return error.into();
    }
    BridgeError::PauseUndo {
        device,
        error: error.to_string(),
        undo: undo.join("; "),
    }
}
