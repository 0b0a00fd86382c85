//! Buffer aggregates: a logical byte sequence made of pieces of immutable
//! buffers, after the aggregate objects of fbufs (Druschel and Peterson,
//! "Fbufs: A High-Bandwidth Cross-Domain Transfer Facility", §3).
//!
//! An [`Aggregate`] is an ordered list of fragments, each a byte range of a
//! buffer that no one writes any more: a read-only [`BufferCopy`] or an owned
//! [`Buffer`] handed to the aggregate, which from then on only reads it. The
//! buffers sit behind reference counts, so splitting, clipping, joining and
//! cloning an aggregate edit the fragment list and copy no payload byte. A
//! buffer goes back to its owner when the last fragment that refers to it is
//! dropped (see [`Aggregate`] for what that means for each kind of buffer).

use crate::ErrorKind;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::sync::Arc;

use crate::buffer::{Buffer, BufferCopy, BufferId};
use crate::error::{Refused, Result};
use crate::proto::FragEntry;

/// The buffer behind a fragment, held read-only.
pub(crate) enum Held {
    /// An owned buffer; dropping it puts it back on its domain's free list.
    Owned(Buffer),
    /// A received copy; dropping it releases it the next time its channel runs.
    Copy(BufferCopy),
}

impl Held {
    #[inline]
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Held::Owned(b) => b,
            Held::Copy(c) => c,
        }
    }

    pub(crate) fn id(&self) -> BufferId {
        match self {
            Held::Owned(b) => b.id(),
            Held::Copy(c) => c.id(),
        }
    }

    /// The domain whose handle this is.
    pub(crate) fn domain_id(&self) -> u64 {
        match self {
            Held::Owned(b) => b.domain_id(),
            Held::Copy(c) => c.domain_id(),
        }
    }
}

/// An aggregate taken apart for sending: its distinct buffer handles, in
/// the order of their first fragment, and the fragment table naming them
/// by position.
pub(crate) struct Parts {
    /// The distinct buffers (`None` once one has been moved away).
    pub members: Vec<Option<Arc<Held>>>,
    /// The fragments in order.
    pub entries: Vec<FragEntry>,
    /// The table as it goes on the wire ([`fold_table`](crate::proto::fold_table)).
    pub wire: Vec<FragEntry>,
}

impl Parts {
    /// The aggregate of the fragments whose buffers are still here (all
    /// of them unless some were moved away).
    pub(crate) fn rebuild(self) -> Aggregate {
        Aggregate::from_table(&self.members, &self.entries)
    }
}

/// One piece of an aggregate: `held[start..end]`, never empty.
#[derive(Clone)]
struct Frag {
    held: Arc<Held>,
    start: usize,
    end: usize,
}

/// The fragments of a received aggregate, kept as the run's table over its
/// members until an edit needs a list: a router that sends the aggregate
/// on as it came sends this table again, and a receiver that takes the
/// fragments off the front ([`Aggregate::append_from`],
/// [`Aggregate::clip_front`]) takes them from the table, moving each
/// member's reference with its last fragment, so neither makes a list of
/// its own nor raises a reference count per fragment.
#[derive(Clone)]
struct Received {
    /// The run's members, in order of their first fragment, one reference
    /// each (`None` once their last fragment is taken).
    members: Vec<Option<Arc<Held>>>,
    /// The fragments (checked against the members when the run arrived:
    /// every one inside its member, none empty).
    entries: Vec<FragEntry>,
    /// Index of the last fragment of each member.
    last: Vec<usize>,
    /// The table as it came on the wire (repeat entries folded).
    wire: Vec<FragEntry>,
    /// The first fragment not taken.
    next: usize,
    /// Bytes of fragment `next` taken off its front.
    off: usize,
}

impl Drop for Received {
    /// The members go as a list's fragments would take them: each with
    /// its last fragment, in the order of those.
    fn drop(&mut self) {
        let mut order: Vec<usize> = (0..self.members.len()).collect();
        order.sort_unstable_by_key(|&m| self.last[m]);
        for m in order {
            self.members[m] = None;
        }
    }
}

impl Received {
    /// Whether nothing was taken off the front.
    fn whole(&self) -> bool {
        self.next == 0 && self.off == 0
    }

    /// Fragment `i` (an index into `entries`, at least `next`) as a view.
    #[inline]
    fn view(&self, i: usize) -> Fragment<'_> {
        let e = &self.entries[i];
        let held = self.members[e.member as usize].as_ref().expect("a member with fragments left is held");
        let start = e.offset as usize + if i == self.next { self.off } else { 0 };
        Fragment { held, start, end: (e.offset + e.len) as usize }
    }

    /// Fragment `next` is gone: its member goes if this was its last.
    fn pass_next(&mut self) {
        let m = self.entries[self.next].member as usize;
        if self.last[m] == self.next {
            self.members[m] = None;
        }
        self.next += 1;
        self.off = 0;
    }
}

impl Frag {
    fn len(&self) -> usize {
        self.end - self.start
    }
}

/// A logical byte sequence made of byte ranges of immutable buffers.
///
/// Made from an owned [`Buffer`] or a read-only [`BufferCopy`] (whole:
/// `Aggregate::from(buffer)`, or a byte range:
/// [`from_buffer_range`](Aggregate::from_buffer_range),
/// [`from_copy_range`](Aggregate::from_copy_range)), or from a few bytes
/// copied into a buffer of the caller's ([`from_bytes_in`](Aggregate::from_bytes_in),
/// for headers and trailers). Aggregates are joined
/// ([`append`](Aggregate::append), [`prepend`](Aggregate::prepend),
/// [`join`](Aggregate::join)), cut ([`split_at`](Aggregate::split_at),
/// [`split_off`](Aggregate::split_off), [`clip_front`](Aggregate::clip_front),
/// [`clip_back`](Aggregate::clip_back), [`truncate`](Aggregate::truncate),
/// [`slice`](Aggregate::slice)) and cloned without copying a payload byte:
/// each of these edits the fragment list only, and a fragment refers to its
/// buffer through a reference count.
///
/// A buffer put into an aggregate is never written again through it: an
/// owned [`Buffer`] is held read-only. When the last fragment referring to a
/// buffer is dropped (by dropping, clipping or splitting away the aggregates
/// that held it), the buffer goes back to its owner as if its handle were
/// dropped: an owned `Buffer` returns to its domain's free list (or waits
/// aside until its outstanding copies are back), a `BufferCopy` is released
/// the next time the channel it arrived on runs.
///
/// The bytes are read through [`fragments`](Aggregate::fragments) (each
/// fragment's bytes in place), [`units`](Aggregate::units) (records or
/// lines as one slice each, copied only when one crosses a fragment
/// boundary), or [`std::io::Read`] / [`std::io::BufRead`], which consume the
/// aggregate from the front.
///
/// ```
/// use std::borrow::Cow;
/// use ferry::{Aggregate, Allocator, Domain, PoolConstraints, Unit};
///
/// let alloc = Allocator::new(&Domain::new("d"), 4, 4096, PoolConstraints::default())?;
/// let mut body = alloc.alloc().unwrap();
/// body.as_mut_slice()?[..12].copy_from_slice(b"one\ntwo\nthr\n");
/// let payload = Aggregate::from_buffer_range(body, 0..12)?;
///
/// // A layer prepends its header, held in a buffer of its own.
/// let mut message = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"HDR:")?;
/// message.append(payload.clone()); // the clone shares the payload's buffer
/// assert_eq!(message.len(), 16);
/// assert_eq!(message.fragments().count(), 2);
///
/// // The receiving layer strips the header; no byte is copied.
/// message.clip_front(4);
/// let mut lines = message.units(Unit::Delimited(b'\n'));
/// assert!(matches!(lines.next(), Some(Cow::Borrowed(b"one\n"))));
/// assert_eq!(lines.by_ref().count(), 2);
/// assert_eq!(lines.copies(), 0, "every line lies inside one fragment");
///
/// drop(message); // the last use of `lines` was above
/// drop(payload);
/// assert_eq!(alloc.available(), 4, "both buffers are back");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct Aggregate {
    /// The fragments, unless `rest` holds them.
    frags: VecDeque<Frag>,
    len: usize,
    /// A received aggregate's fragments still as its table (then `frags`
    /// is empty; `None` once they are all taken or put on the list).
    rest: Option<Box<Received>>,
}

/// One fragment of an [`Aggregate`]: a byte range of one buffer.
#[derive(Clone, Copy)]
pub struct Fragment<'a> {
    held: &'a Arc<Held>,
    start: usize,
    end: usize,
}

impl<'a> Fragment<'a> {
    #[inline]
    fn of(frag: &'a Frag) -> Self {
        Fragment { held: &frag.held, start: frag.start, end: frag.end }
    }

    /// The fragment's bytes, in the buffer's memory (never empty).
    #[inline]
    pub fn bytes(&self) -> &'a [u8] {
        let held: &'a Held = self.held;
        &held.bytes()[self.start..self.end]
    }

    /// The buffer the bytes are in.
    pub fn buffer_id(&self) -> BufferId {
        self.held.id()
    }

    /// The byte range of the buffer this fragment covers.
    #[inline]
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// Whether the buffer is a read-only copy received over a channel
    /// (`false`: a buffer this domain owns, held read-only).
    pub fn is_copy(&self) -> bool {
        matches!(**self.held, Held::Copy(_))
    }

    /// Whether `self` and `other` refer to the same buffer handle (one put
    /// into an aggregate once, shared since by clones and splits).
    pub fn same_buffer(&self, other: &Fragment<'_>) -> bool {
        Arc::ptr_eq(self.held, other.held)
    }
}

/// The fragments of an aggregate in order ([`Aggregate::fragments`]).
struct Fragments<'a> {
    list: std::collections::vec_deque::Iter<'a, Frag>,
    rest: Option<&'a Received>,
    /// The table's fragments `front..back` not yet given.
    front: usize,
    back: usize,
}

impl<'a> Iterator for Fragments<'a> {
    type Item = Fragment<'a>;

    #[inline]
    fn next(&mut self) -> Option<Fragment<'a>> {
        if let Some(f) = self.list.next() {
            return Some(Fragment::of(f));
        }
        let rest = self.rest?;
        (self.front < self.back).then(|| {
            self.front += 1;
            rest.view(self.front - 1)
        })
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.list.len() + (self.back - self.front);
        (n, Some(n))
    }
}

impl DoubleEndedIterator for Fragments<'_> {
    #[inline]
    fn next_back(&mut self) -> Option<Self::Item> {
        if let Some(rest) = self.rest.filter(|_| self.front < self.back) {
            self.back -= 1;
            return Some(rest.view(self.back));
        }
        self.list.next_back().map(Fragment::of)
    }
}

impl ExactSizeIterator for Fragments<'_> {}

impl fmt::Debug for Fragment<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fragment")
            .field("buffer", &self.buffer_id())
            .field("range", &self.range())
            .field("copy", &self.is_copy())
            .finish()
    }
}

/// `start..end` checked against `len`.
fn check_range(range: &Range<usize>, len: usize) -> Result<()> {
    if range.start > range.end || range.end > len {
        return Err(ErrorKind::BadRange { start: range.start, end: range.end, len }.into());
    }
    Ok(())
}

impl Aggregate {
    /// An empty aggregate.
    pub fn new() -> Self {
        Aggregate::default()
    }

    fn from_held(held: Held, range: Range<usize>) -> Self {
        let mut a = Aggregate::new();
        if !range.is_empty() {
            a.len = range.len();
            a.frags.push_back(Frag { held: Arc::new(held), start: range.start, end: range.end });
        }
        // An empty range: `held` is dropped here and goes back at once.
        a
    }

    /// The bytes `range` of an owned buffer, which the aggregate holds
    /// read-only from now on. [`ErrorKind::BadRange`] (the buffer handed back)
    /// if the range does not lie inside the buffer.
    pub fn from_buffer_range(buffer: Buffer, range: Range<usize>) -> Result<Self, Refused<Buffer>> {
        if let Err(e) = check_range(&range, buffer.len()) {
            return Err(Refused::new(e, buffer));
        }
        Ok(Aggregate::from_held(Held::Owned(buffer), range))
    }

    /// The bytes `range` of a read-only copy. [`ErrorKind::BadRange`] (the copy
    /// handed back) if the range does not lie inside the buffer.
    pub fn from_copy_range(copy: BufferCopy, range: Range<usize>) -> Result<Self, Refused<BufferCopy>> {
        if let Err(e) = check_range(&range, copy.len()) {
            return Err(Refused::new(e, copy));
        }
        Ok(Aggregate::from_held(Held::Copy(copy), range))
    }

    /// `bytes` copied into the front of `buffer` (a buffer from an
    /// allocator of the caller's choosing, typically one of small buffers
    /// for headers and trailers), as an aggregate of `bytes.len()` bytes
    /// holding the buffer read-only. These are the only bytes an aggregate
    /// ever copies in. The buffer is handed back with
    /// [`ErrorKind::CopiesOutstanding`] if copies of it are out, or
    /// [`ErrorKind::BadRange`] if `bytes` is longer than the buffer.
    pub fn from_bytes_in(mut buffer: Buffer, bytes: &[u8]) -> Result<Self, Refused<Buffer>> {
        if let Err(e) = check_range(&(0..bytes.len()), buffer.len()) {
            return Err(Refused::new(e, buffer));
        }
        match buffer.as_mut_slice() {
            Ok(dst) => dst[..bytes.len()].copy_from_slice(bytes),
            Err(e) => return Err(Refused::new(e, buffer)),
        }
        Ok(Aggregate::from_held(Held::Owned(buffer), 0..bytes.len()))
    }

    /// Number of bytes in the aggregate.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the aggregate holds no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fragments in order; their bytes, one after the other, are the
    /// aggregate's bytes. No fragment is empty.
    #[inline]
    pub fn fragments(&self) -> impl ExactSizeIterator<Item = Fragment<'_>> + DoubleEndedIterator + '_ {
        let rest = self.rest.as_deref();
        Fragments {
            list: self.frags.iter(),
            rest,
            front: rest.map_or(0, |r| r.next),
            back: rest.map_or(0, |r| r.entries.len()),
        }
    }

    /// Fragment `i` (0: the first).
    #[inline]
    fn frag_at(&self, i: usize) -> Option<Fragment<'_>> {
        match self.rest.as_deref() {
            Some(r) => (r.next + i < r.entries.len()).then(|| r.view(r.next + i)),
            None => self.frags.get(i).map(Fragment::of),
        }
    }

    /// The aggregate's bytes, copied into one vector (for small aggregates
    /// and checks; the other readers copy nothing or less).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len);
        for f in self.fragments() {
            v.extend_from_slice(f.bytes());
        }
        v
    }

    /// A received aggregate's fragments still kept as its table put on
    /// the list (before an edit the table cannot take).
    #[inline]
    fn materialize(&mut self) {
        if self.rest.is_some() {
            self.materialize_table();
        }
    }

    #[cold]
    fn materialize_table(&mut self) {
        let Some(r) = self.rest.take() else { return };
        let (members, entries, next, off) = (&r.members, &r.entries, r.next, r.off);
        let mut frags = Vec::with_capacity(entries.len() - next);
        for (i, e) in entries[next..].iter().enumerate() {
            let held = members[e.member as usize].as_ref().expect("a member with fragments left is held");
            let start = e.offset as usize + if i == 0 { off } else { 0 };
            frags.push(Frag { held: Arc::clone(held), start, end: (e.offset + e.len) as usize });
        }
        self.frags = VecDeque::from(frags);
    }

    /// Put one fragment after the others, merged with the last one where
    /// the two are adjacent ranges of one buffer.
    fn push_frag(&mut self, frag: Frag) {
        debug_assert!(self.rest.is_none());
        self.len += frag.len();
        if let Some(last) = self.frags.back_mut() {
            if Arc::ptr_eq(&last.held, &frag.held) && last.end == frag.start {
                last.end = frag.end;
                return;
            }
        }
        self.frags.push_back(frag);
    }

    /// The start of [`append`](Aggregate::append) and
    /// [`prepend`](Aggregate::prepend): `true` if one side is empty, so
    /// the other is the result as it is (a received table stays a table);
    /// else both are made lists, to be joined.
    fn join_without_lists(&mut self, other: &mut Aggregate) -> bool {
        if self.is_empty() {
            *self = std::mem::take(other);
            return true;
        }
        if other.is_empty() {
            return true;
        }
        self.materialize();
        other.materialize();
        false
    }

    /// Put `other`'s bytes after this aggregate's. Where this aggregate's
    /// last fragment and `other`'s first are adjacent ranges of one buffer
    /// (pieces of one split, joined back), they become one fragment again.
    pub fn append(&mut self, mut other: Aggregate) {
        if self.join_without_lists(&mut other) {
            return;
        }
        self.len += other.len;
        if let (Some(last), Some(first)) = (self.frags.back_mut(), other.frags.front()) {
            if Arc::ptr_eq(&last.held, &first.held) && last.end == first.start {
                last.end = first.end;
                other.frags.pop_front();
            }
        }
        if self.frags.is_empty() {
            self.frags = other.frags;
        } else {
            self.frags.append(&mut other.frags);
        }
    }

    /// Put `other`'s bytes before this aggregate's (a header); adjacent
    /// ranges of one buffer merge as in [`append`](Aggregate::append).
    pub fn prepend(&mut self, mut other: Aggregate) {
        if self.join_without_lists(&mut other) {
            return;
        }
        self.len += other.len;
        if let (Some(first), Some(last)) = (self.frags.front_mut(), other.frags.back()) {
            if Arc::ptr_eq(&first.held, &last.held) && last.end == first.start {
                first.start = last.start;
                other.frags.pop_back();
            }
        }
        while let Some(f) = other.frags.pop_back() {
            self.frags.push_front(f);
        }
    }

    /// This aggregate's bytes followed by `other`'s.
    pub fn join(mut self, other: Aggregate) -> Aggregate {
        self.append(other);
        self
    }

    /// Keep the first `at` bytes, and return the rest as a new aggregate.
    /// A fragment that `at` falls inside is split into two fragments of the
    /// same buffer. [`ErrorKind::BadRange`] (nothing changed) if `at` is past
    /// the end. The fragments after the cut move to a new list, so to
    /// consume a long aggregate from the front piece by piece, take the
    /// pieces with [`split_to`](Aggregate::split_to) or
    /// [`append_from`](Aggregate::append_from) instead.
    pub fn split_off(&mut self, at: usize) -> Result<Aggregate> {
        check_range(&(at..self.len), self.len)?;
        if at == 0 {
            // The whole list moves: no new list, nothing walked.
            return Ok(std::mem::take(self));
        }
        self.materialize();
        let mut pos = 0;
        let mut i = 0;
        while i < self.frags.len() && pos + self.frags[i].len() <= at {
            pos += self.frags[i].len();
            i += 1;
        }
        let mut tail = Aggregate { frags: self.frags.split_off(i), len: self.len - at, rest: None };
        if at > pos {
            // `at` falls inside the tail's first fragment: split it in two.
            let front = tail.frags.front_mut().expect("at < len, so the tail has a fragment");
            let cut = front.start + (at - pos);
            self.frags.push_back(Frag { held: Arc::clone(&front.held), start: front.start, end: cut });
            front.start = cut;
        }
        self.len = at;
        Ok(tail)
    }

    /// Take the first `at` bytes off the front, as a new aggregate, and
    /// keep the rest: the counterpart of [`split_off`](Aggregate::split_off)
    /// for consuming an aggregate from the front (unit by unit, header by
    /// header). It costs time in the number of fragments taken, not in the
    /// number left, so cutting a long aggregate into pieces from the front
    /// costs time in its number of fragments overall. A fragment that `at`
    /// falls inside is split into two fragments of the same buffer.
    /// [`ErrorKind::BadRange`] (nothing changed) if `at` is past the end.
    ///
    /// ```
    /// use ferry::{Aggregate, Allocator, Domain, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default())?;
    /// let mut rest = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"hdr1body")?;
    /// let head = rest.split_to(4)?;
    /// assert_eq!((head.to_vec(), rest.to_vec()), (b"hdr1".to_vec(), b"body".to_vec()));
    /// assert!(rest.split_to(5).is_err());
    /// assert_eq!(rest.len(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn split_to(&mut self, at: usize) -> Result<Aggregate> {
        let mut head = Aggregate::new();
        head.append_from(self, at)?;
        Ok(head)
    }

    /// Make room for at least `additional` more fragments, so that
    /// building a long aggregate piece by piece (a train of units behind
    /// their headers) does not grow its fragment list again and again.
    ///
    /// ```
    /// use ferry::{Aggregate, Allocator, Domain, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 2, 4096, PoolConstraints::default())?;
    /// let mut body = Aggregate::from(alloc.alloc().unwrap());
    /// let mut hdrs = Aggregate::from(alloc.alloc().unwrap());
    /// let mut train = Aggregate::new();
    /// train.reserve(2 * 4);
    /// for _ in 0..4 {
    ///     train.append_from(&mut hdrs, 16)?;
    ///     train.append_from(&mut body, 1024)?;
    /// }
    /// assert_eq!((train.len(), train.fragments().len()), (4 * 1040, 8));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reserve(&mut self, additional: usize) {
        self.materialize();
        self.frags.reserve(additional);
    }

    /// Move the first `n` bytes of `src` to the end of this aggregate:
    /// `self.append(src.split_to(n)?)` without the aggregate in between (no
    /// fragment list made for it), for fragmenting and reassembling unit by
    /// unit. Costs time in the number of fragments moved; adjacent ranges of
    /// one buffer merge as in [`append`](Aggregate::append). A fragment of
    /// `src` that `n` falls inside is split into two fragments of the same
    /// buffer. [`ErrorKind::BadRange`] (nothing changed) if `src` is shorter
    /// than `n`.
    ///
    /// ```
    /// use ferry::{Aggregate, Allocator, Domain, Error, ErrorKind, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 2, 4096, PoolConstraints::default())?;
    /// let mut src = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"abcdefgh")?;
    /// let mut dst = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"[")?;
    /// dst.append_from(&mut src, 3)?;
    /// dst.append_from(&mut src, 2)?; // merges with "abc": one fragment "abcde"
    /// assert_eq!((dst.to_vec(), src.to_vec()), (b"[abcde".to_vec(), b"fgh".to_vec()));
    /// assert_eq!(dst.fragments().count(), 2);
    /// assert_eq!(dst.append_from(&mut src, 4), Err(ErrorKind::BadRange { start: 4, end: 3, len: 3 }.into()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn append_from(&mut self, src: &mut Aggregate, n: usize) -> Result<()> {
        check_range(&(n..src.len), src.len)?;
        if n == src.len {
            // All of `src`: its list moves as a whole.
            self.append(std::mem::take(src));
            return Ok(());
        }
        self.materialize();
        src.len -= n;
        if let Some(r) = src.rest.as_deref_mut() {
            self.take_from_table(r, n);
            return Ok(());
        }
        let mut left = n;
        while left > 0 {
            let front = src.frags.front_mut().expect("n < len, so a fragment is left");
            if front.len() <= left {
                left -= front.len();
                let f = src.frags.pop_front().expect("a front fragment");
                self.push_frag(f);
            } else {
                let cut = front.start + left;
                let piece = Frag { held: Arc::clone(&front.held), start: front.start, end: cut };
                front.start = cut;
                self.push_frag(piece);
                left = 0;
            }
        }
        Ok(())
    }

    /// Move the first `n` bytes of a received table (fewer than it has)
    /// to the end of this aggregate: a piece that continues the last
    /// fragment extends it, and a fragment taken whole takes its member's
    /// reference along if it is the member's last, so the reference
    /// counts change only for fragments that neither merge nor end their
    /// member.
    fn take_from_table(&mut self, r: &mut Received, n: usize) {
        let mut left = n;
        self.len += n;
        while left > 0 {
            let i = r.next;
            let e = r.entries[i];
            let m = e.member as usize;
            let (start, end) = (e.offset as usize + r.off, (e.offset + e.len) as usize);
            let take = left.min(end - start);
            left -= take;
            let held = r.members[m].as_ref().expect("a member with fragments left is held");
            let merged = match self.frags.back_mut() {
                Some(last) if last.end == start && Arc::ptr_eq(&last.held, held) => {
                    last.end = start + take;
                    true
                }
                _ => false,
            };
            if take < end - start {
                if !merged {
                    let held = Arc::clone(held);
                    self.frags.push_back(Frag { held, start, end: start + take });
                }
                r.off += take;
                continue;
            }
            // Fragment `i` taken whole: its member's reference goes along
            // (or, merged, goes) if this was the member's last fragment.
            let last = r.last[m] == i;
            if !merged {
                let held = if last { r.members[m].take().expect("held") } else { Arc::clone(held) };
                self.frags.push_back(Frag { held, start, end });
            } else if last {
                r.members[m] = None;
            }
            r.next += 1;
            r.off = 0;
        }
    }

    /// The first `offset` bytes and the rest, sharing this aggregate's
    /// buffers; [`ErrorKind::BadRange`] if `offset` is past the end.
    ///
    /// ```
    /// use ferry::{Aggregate, Allocator, Domain, Error, ErrorKind, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default())?;
    /// let whole = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"headerbody")?;
    /// let (head, body) = whole.split_at(6)?;
    /// assert_eq!((head.to_vec(), body.to_vec()), (b"header".to_vec(), b"body".to_vec()));
    /// let (h, b) = (head.fragments().next().unwrap(), body.fragments().next().unwrap());
    /// assert!(h.same_buffer(&b) && h.range() == (0..6) && b.range() == (6..10));
    /// assert_eq!(whole.split_at(11).unwrap_err(), ErrorKind::BadRange { start: 11, end: 10, len: 10 });
    /// drop((whole, head, body));
    /// assert_eq!(alloc.available(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn split_at(&self, offset: usize) -> Result<(Aggregate, Aggregate)> {
        let mut head = self.clone();
        let tail = head.split_off(offset)?;
        Ok((head, tail))
    }

    /// The bytes `range` of this aggregate, sharing its buffers;
    /// [`ErrorKind::BadRange`] if the range does not lie inside it.
    pub fn slice(&self, range: Range<usize>) -> Result<Aggregate> {
        check_range(&range, self.len)?;
        let mut a = self.clone();
        a.truncate(range.end);
        a.clip_front(range.start);
        Ok(a)
    }

    /// Drop the first `n` bytes (all of them if `n` is larger).
    pub fn clip_front(&mut self, n: usize) {
        let mut n = n.min(self.len);
        self.len -= n;
        if let Some(r) = self.rest.as_deref_mut() {
            while n > 0 {
                let left = r.entries[r.next].len as usize - r.off;
                if left <= n {
                    n -= left;
                    r.pass_next();
                } else {
                    r.off += n;
                    n = 0;
                }
            }
            if self.len == 0 {
                self.rest = None;
            }
            return;
        }
        while n > 0 {
            let front = self.frags.front_mut().expect("n <= len");
            if front.len() <= n {
                n -= front.len();
                self.frags.pop_front();
            } else {
                front.start += n;
                n = 0;
            }
        }
    }

    /// Drop the last `n` bytes (all of them if `n` is larger).
    pub fn clip_back(&mut self, n: usize) {
        self.materialize();
        let mut n = n.min(self.len);
        self.len -= n;
        while n > 0 {
            let back = self.frags.back_mut().expect("n <= len");
            if back.len() <= n {
                n -= back.len();
                self.frags.pop_back();
            } else {
                back.end -= n;
                n = 0;
            }
        }
    }

    /// Keep the first `len` bytes (nothing changes if `len` is not smaller
    /// than [`len`](Aggregate::len)).
    pub fn truncate(&mut self, len: usize) {
        self.clip_back(self.len.saturating_sub(len));
    }

    /// The aggregate's bytes cut into units, each one contiguous slice:
    /// borrowed from the buffer when the unit lies inside one fragment,
    /// copied into a vector only when it crosses a fragment boundary
    /// ([`Units::copies`] counts those).
    pub fn units(&self, unit: Unit) -> Units<'_> {
        Units { agg: self, frag: 0, off: 0, pos: 0, unit, copies: 0, copied_bytes: 0 }
    }
}

/// A buffer handle taken back out of an aggregate
/// ([`Aggregate::into_members`]).
#[derive(Debug)]
pub enum Member {
    /// A buffer this domain owns (read-write again once no copies are out).
    Buffer(Buffer),
    /// A read-only copy this domain holds.
    Copy(BufferCopy),
}

impl Aggregate {
    /// The aggregate's buffers as handles again, one per distinct buffer in
    /// the order of their first fragment: an owned [`Buffer`] can then be
    /// written, moved or passed back to its sender (fbufs' buffer caching
    /// with the channel operations), a [`BufferCopy`] released or forwarded.
    /// Only when the aggregate is the last reference to each of them:
    /// otherwise (a clone or a piece of a split still refers to one) the
    /// aggregate comes back unchanged.
    ///
    /// ```
    /// use ferry::{Aggregate, Allocator, Domain, Member, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 2, 4096, PoolConstraints::default())?;
    /// let agg = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"abc")?;
    /// let other = agg.clone();
    /// let agg = agg.into_members().unwrap_err(); // `other` shares the buffer
    /// drop(other);
    /// let Ok(mut members) = agg.into_members() else { panic!() };
    /// let Some(Member::Buffer(mut buf)) = members.pop() else { panic!() };
    /// assert_eq!(&buf[..3], b"abc");
    /// buf.as_mut_slice()?[0] = b'x'; // ours to write again
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn into_members(mut self) -> Result<Vec<Member>, Aggregate> {
        self.materialize();
        let (members, entries) = self.distinct();
        let mut refs = vec![0usize; members.len()];
        for e in &entries {
            refs[e.member as usize] += 1;
        }
        if members.iter().zip(&refs).any(|(m, n)| Arc::strong_count(m) != *n) {
            return Err(self);
        }
        Ok(self
            .into_parts()
            .members
            .into_iter()
            .flatten()
            .map(|held| match Arc::try_unwrap(held) {
                Ok(Held::Owned(b)) => Member::Buffer(b),
                Ok(Held::Copy(c)) => Member::Copy(c),
                Err(_) => unreachable!("the aggregate held the only references"),
            })
            .collect())
    }

    /// The distinct buffer handles (in the order of their first fragment)
    /// and the fragment table, without taking the aggregate apart: for the
    /// checks before a send.
    pub(crate) fn distinct(&self) -> (Vec<&Arc<Held>>, Vec<FragEntry>) {
        debug_assert!(self.rest.is_none(), "a list, not a received table");
        let mut members: Vec<&Arc<Held>> = Vec::new();
        let mut entries = Vec::with_capacity(self.frags.len());
        // The members of the last two fragments, tried first: headers
        // interleaved with pieces of one payload alternate between two.
        let mut recent = [0usize; 2];
        for f in &self.frags {
            let is = |i: usize| members.get(i).is_some_and(|m| Arc::ptr_eq(m, &f.held));
            let member = if is(recent[1]) {
                recent[1]
            } else if is(recent[0]) {
                recent[0]
            } else {
                // Linear search: aggregates have few distinct buffers; a
                // map keyed by address pays off only for hundreds.
                match members.iter().position(|m| Arc::ptr_eq(m, &f.held)) {
                    Some(i) => i,
                    None => {
                        members.push(&f.held);
                        members.len() - 1
                    }
                }
            };
            if member != recent[1] {
                recent = [recent[1], member];
            }
            entries.push(FragEntry { member: member as u32, offset: f.start as u64, len: f.len() as u64 });
        }
        (members, entries)
    }

    /// Take the aggregate apart: afterwards each member's reference count
    /// counts this aggregate once (and every other aggregate or clone that
    /// shares the buffer). The parts' `wire` is left empty.
    pub(crate) fn into_parts(mut self) -> Parts {
        if self.received_members().is_some() {
            return self.into_parts_with(0, None);
        }
        self.materialize();
        let (members, entries) = self.distinct();
        let n = members.len();
        self.into_parts_with(n, Some((entries, Vec::new())))
    }

    /// Made ready for [`received_members`](Aggregate::received_members)
    /// or [`distinct`](Aggregate::distinct): a received table taken from
    /// (not whole any more) is put on the list.
    pub(crate) fn settle(&mut self) {
        if !self.rest.as_ref().is_some_and(|r| r.whole()) {
            self.materialize();
        }
    }

    /// The members of an aggregate received and not edited since, in the
    /// order of their first fragment (`None` for any other aggregate).
    pub(crate) fn received_members(&self) -> Option<Vec<&Arc<Held>>> {
        let r = self.rest.as_deref().filter(|r| r.whole())?;
        Some(r.members.iter().map(|m| m.as_ref().expect("a whole table holds every member")).collect())
    }

    /// The fragments and the entries on the wire of an aggregate received
    /// and not edited since.
    pub(crate) fn received_counts(&self) -> Option<(usize, usize)> {
        self.rest.as_deref().filter(|r| r.whole()).map(|r| (r.entries.len(), r.wire.len()))
    }

    /// [`into_parts`](Aggregate::into_parts) with the table
    /// [`distinct`](Aggregate::distinct) made (`members` distinct buffers,
    /// `table` one entry per fragment and the table on the wire): the
    /// table is not made again, and each member keeps the reference of
    /// its first fragment, so no reference count is raised. An aggregate
    /// received and not edited since (`table` is `None`) gives the table
    /// it came with.
    pub(crate) fn into_parts_with(self, members: usize, table: Option<(Vec<FragEntry>, Vec<FragEntry>)>) -> Parts {
        let Some((entries, wire)) = table else {
            let mut r = self.rest.filter(|r| r.whole()).expect("a received table, whole");
            use std::mem::take;
            return Parts { members: take(&mut r.members), entries: take(&mut r.entries), wire: take(&mut r.wire) };
        };
        debug_assert_eq!(entries.len(), self.frags.len());
        let mut held: Vec<Option<Arc<Held>>> = vec![None; members];
        for (f, e) in self.frags.into_iter().zip(&entries) {
            let slot = &mut held[e.member as usize];
            if slot.is_none() {
                *slot = Some(f.held);
            }
        }
        Parts { members: held, entries, wire }
    }

    /// The aggregate a received run describes: `members` in the order
    /// they arrived, `entries` checked against them
    /// ([`AggRun`](crate::proto::AggRun) did), `wire` the table as it came.
    /// Kept as that table (no list, no reference per fragment) unless the
    /// members are not in the order of their first fragment or two
    /// fragments in a row are adjacent bytes of one buffer (which a list
    /// holds as one fragment): then made a list at once.
    pub(crate) fn from_received(members: Vec<Held>, entries: Vec<FragEntry>, wire: Vec<FragEntry>) -> Aggregate {
        let members: Vec<Option<Arc<Held>>> = members.into_iter().map(|h| Some(Arc::new(h))).collect();
        let mut last = vec![0usize; members.len()];
        let (mut seen, mut len) = (0, 0);
        let mut plain = !entries.is_empty();
        for (i, e) in entries.iter().enumerate() {
            let m = e.member as usize;
            let joins = i > 0 && {
                let p = &entries[i - 1];
                p.member == e.member && p.offset + p.len == e.offset
            };
            if m > seen || joins {
                plain = false;
                break;
            }
            seen += usize::from(m == seen);
            last[m] = i;
            len += e.len as usize;
        }
        if !plain || seen != members.len() {
            return Aggregate::from_table(&members, &entries);
        }
        let rest = Received { members, entries, last, wire, next: 0, off: 0 };
        Aggregate { frags: VecDeque::new(), len, rest: Some(Box::new(rest)) }
    }

    /// The fragments `entries` of the `members` still present (entries
    /// naming a member that is `None` or absent are left out).
    fn from_table(members: &[Option<Arc<Held>>], entries: &[FragEntry]) -> Aggregate {
        // One list for every fragment, no allocation per entry; built as a
        // vector (cheaper to push onto than the deque, which takes it over
        // without copying). Adjacent ranges of one buffer merge as in
        // `push_frag`.
        let mut frags: Vec<Frag> = Vec::with_capacity(entries.len());
        let mut len = 0;
        for e in entries {
            if let Some(Some(held)) = members.get(e.member as usize) {
                let (start, end) = (e.offset as usize, (e.offset + e.len) as usize);
                len += end - start;
                if let Some(last) = frags.last_mut() {
                    if last.end == start && Arc::ptr_eq(&last.held, held) {
                        last.end = end;
                        continue;
                    }
                }
                frags.push(Frag { held: Arc::clone(held), start, end });
            }
        }
        Aggregate { frags: VecDeque::from(frags), len, rest: None }
    }
}

impl From<Buffer> for Aggregate {
    /// The whole buffer, held read-only from now on.
    fn from(buffer: Buffer) -> Self {
        let len = buffer.len();
        Aggregate::from_held(Held::Owned(buffer), 0..len)
    }
}

impl From<BufferCopy> for Aggregate {
    /// The whole copy.
    fn from(copy: BufferCopy) -> Self {
        let len = copy.len();
        Aggregate::from_held(Held::Copy(copy), 0..len)
    }
}

impl fmt::Debug for Aggregate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aggregate")
            .field("len", &self.len)
            .field("fragments", &self.fragments().collect::<Vec<_>>())
            .finish()
    }
}

/// Reads the bytes from the front, consuming them (the buffers of the
/// bytes read go back once no fragment refers to them).
impl io::Read for Aggregate {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let Some(front) = self.frag_at(0) else { break };
            let src = front.bytes();
            let n = src.len().min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&src[..n]);
            done += n;
            self.clip_front(n);
        }
        Ok(done)
    }
}

/// [`fill_buf`](io::BufRead::fill_buf) gives the first fragment's bytes in
/// place; [`consume`](io::BufRead::consume) clips them off the front.
impl io::BufRead for Aggregate {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        Ok(self.frag_at(0).map_or(&[][..], |f| f.bytes()))
    }

    fn consume(&mut self, amt: usize) {
        self.clip_front(amt);
    }
}

/// [`bytes::Buf`] over the aggregate's bytes, consuming them from the front
/// like [`std::io::Read`]: [`chunk`](bytes::Buf::chunk) is the first
/// fragment in place, [`chunks_vectored`](bytes::Buf::chunks_vectored) the
/// fragments in order. Advancing past the end clips everything (no panic).
#[cfg(feature = "bytes")]
#[cfg_attr(docsrs, doc(cfg(feature = "bytes")))]
impl bytes::Buf for Aggregate {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        self.frag_at(0).map_or(&[][..], |f| f.bytes())
    }

    fn advance(&mut self, cnt: usize) {
        self.clip_front(cnt);
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [io::IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, f) in dst.iter_mut().zip(self.fragments()) {
            *slot = io::IoSlice::new(f.bytes());
            n += 1;
        }
        n
    }
}

/// What [`Aggregate::units`] cuts the bytes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Records of this many bytes; the last one is shorter if the length is
    /// not a multiple.
    Fixed(NonZeroUsize),
    /// Runs of bytes up to and including this delimiter (such as `b'\n'`);
    /// the last run lacks the delimiter if the bytes do not end with one.
    Delimited(u8),
}

/// The units of an aggregate, in order, each one contiguous slice
/// ([`Aggregate::units`]). A unit is borrowed from the buffer when it lies
/// inside one fragment, and copied into a vector when it crosses a fragment
/// boundary; [`copies`](Units::copies) and
/// [`copied_bytes`](Units::copied_bytes) count those copies.
#[derive(Debug, Clone)]
pub struct Units<'a> {
    agg: &'a Aggregate,
    /// Index of the fragment the next unit starts in.
    frag: usize,
    /// Offset of the next unit in that fragment's bytes.
    off: usize,
    /// Bytes before the next unit.
    pos: usize,
    unit: Unit,
    copies: usize,
    copied_bytes: usize,
}

impl Units<'_> {
    /// How many units so far crossed a fragment boundary and were copied.
    pub fn copies(&self) -> usize {
        self.copies
    }

    /// How many bytes those copies held.
    pub fn copied_bytes(&self) -> usize {
        self.copied_bytes
    }

    /// Move the position `n` bytes on from fragment `frag`, offset `off`.
    fn step(&mut self, mut n: usize) {
        self.pos += n;
        while n > 0 {
            let left = self.agg.frag_at(self.frag).expect("n <= what is left").bytes().len() - self.off;
            if n < left {
                self.off += n;
                return;
            }
            n -= left;
            self.frag += 1;
            self.off = 0;
        }
        if self.agg.frag_at(self.frag).is_some_and(|f| self.off == f.bytes().len()) {
            self.frag += 1;
            self.off = 0;
        }
    }

    /// The length of the unit that starts at the current position (at
    /// least one byte, at most what is left).
    fn unit_len(&self) -> usize {
        match self.unit {
            Unit::Fixed(n) => n.get().min(self.agg.len - self.pos),
            Unit::Delimited(d) => {
                let mut len = 0;
                let rest = self.agg.fragments().skip(self.frag).enumerate();
                for bytes in rest.map(|(i, f)| if i == 0 { &f.bytes()[self.off..] } else { f.bytes() }) {
                    match bytes.iter().position(|&b| b == d) {
                        Some(i) => return len + i + 1,
                        None => len += bytes.len(),
                    }
                }
                len
            }
        }
    }
}

impl<'a> Iterator for Units<'a> {
    type Item = Cow<'a, [u8]>;

    fn next(&mut self) -> Option<Cow<'a, [u8]>> {
        let agg: &'a Aggregate = self.agg;
        let first = agg.frag_at(self.frag)?.bytes();
        let len = self.unit_len();
        let here = &first[self.off..];
        let unit = if len <= here.len() {
            Cow::Borrowed(&here[..len])
        } else {
            let mut v = Vec::with_capacity(len);
            let mut i = self.frag;
            let mut src = here;
            while v.len() < len {
                let n = src.len().min(len - v.len());
                v.extend_from_slice(&src[..n]);
                i += 1;
                src = agg.frag_at(i).map_or(&[][..], |f| f.bytes());
            }
            self.copies += 1;
            self.copied_bytes += len;
            Cow::Owned(v)
        };
        self.step(len);
        Some(unit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Allocator, Domain, PoolConstraints};
    use std::io::{BufRead, Read};

    /// An allocator of `count` 4 KiB buffers.
    fn alloc(count: u64) -> Allocator {
        Allocator::new(&Domain::new("agg"), count, 4096, PoolConstraints::default()).unwrap()
    }

    /// An aggregate of `bytes` in one buffer of `a`.
    fn agg(a: &Allocator, bytes: &[u8]) -> Aggregate {
        Aggregate::from_bytes_in(a.alloc().unwrap(), bytes).unwrap()
    }

    fn fixed(n: usize) -> Unit {
        Unit::Fixed(NonZeroUsize::new(n).unwrap())
    }

    #[test]
    fn construction_whole_and_ranges() {
        let a = alloc(4);
        let mut b = a.alloc().unwrap();
        b.as_mut_slice().unwrap()[..4].copy_from_slice(b"wxyz");
        let id = b.id();
        let whole = Aggregate::from(b);
        assert_eq!((whole.len(), whole.fragments().len()), (4096, 1));
        let f = whole.fragments().next().unwrap();
        assert_eq!((f.buffer_id(), f.range(), f.is_copy(), &f.bytes()[..4]), (id, 0..4096, false, &b"wxyz"[..]));

        let b = a.alloc().unwrap();
        let r = Aggregate::from_buffer_range(b, 10..4097).unwrap_err();
        assert_eq!(r.error, ErrorKind::BadRange { start: 10, end: 4097, len: 4096 });
        let b = r.into_inner();
        #[allow(clippy::reversed_empty_ranges)]
        let r = Aggregate::from_buffer_range(b, 5..4).unwrap_err();
        assert!(matches!(r.error.kind(), ErrorKind::BadRange { .. }));
        let part = Aggregate::from_buffer_range(r.into_inner(), 100..200).unwrap();
        assert_eq!((part.len(), part.fragments().next().unwrap().range()), (100, 100..200));

        // An empty range keeps nothing: the buffer is back at once.
        let before = a.available();
        let empty = Aggregate::from_buffer_range(a.alloc().unwrap(), 7..7).unwrap();
        assert!(empty.is_empty() && empty.fragments().len() == 0);
        assert_eq!(a.available(), before);
        assert!(Aggregate::new().is_empty());
    }

    #[test]
    fn from_bytes_in_checks_length_and_copies_out() {
        let a = alloc(2);
        let big = vec![1u8; 4097];
        let r = Aggregate::from_bytes_in(a.alloc().unwrap(), &big).unwrap_err();
        assert_eq!(r.error, ErrorKind::BadRange { start: 0, end: 4097, len: 4096 });
        let b = r.into_inner();
        let h = Aggregate::from_bytes_in(b, b"head").unwrap();
        assert_eq!(h.to_vec(), b"head");

        // A buffer with copies out cannot take the bytes: handed back.
        let d = Domain::new("d");
        let a = Allocator::new(&d, 1, 4096, PoolConstraints::default()).unwrap();
        let b = a.alloc().unwrap();
        let key = d.new_chan_key();
        d.lock().copy_sent(b.id(), key);
        let r = Aggregate::from_bytes_in(b, b"x").unwrap_err();
        assert_eq!(r.error, ErrorKind::CopiesOutstanding);
        let b = r.into_inner();
        d.lock().copy_returned(b.id(), key);
        assert_eq!(Aggregate::from_bytes_in(b, b"x").unwrap().to_vec(), b"x");
    }

    #[test]
    fn buffers_go_back_when_the_last_fragment_goes() {
        let a = alloc(3);
        let x = agg(&a, b"0123456789");
        let y = x.clone();
        let (h, t) = x.split_at(4).unwrap();
        assert_eq!(a.available(), 2);
        drop(x);
        drop(y);
        drop(h);
        assert_eq!(a.available(), 2, "the tail still refers to the buffer");
        let mut t = t;
        t.clip_front(100);
        assert!(t.is_empty());
        assert_eq!(a.available(), 3, "clipping the last byte away gave it back");
    }

    #[test]
    fn append_prepend_join() {
        let a = alloc(4);
        let mut m = agg(&a, b"body");
        m.prepend(agg(&a, b"H1"));
        m.append(agg(&a, b"T"));
        assert_eq!(m.to_vec(), b"H1bodyT");
        let j = Aggregate::new().join(m.clone()).join(Aggregate::new());
        assert_eq!((j.to_vec(), j.len(), j.fragments().len()), (b"H1bodyT".to_vec(), 7, 3));
        let mut e = Aggregate::new();
        e.prepend(j);
        assert_eq!(e.to_vec(), b"H1bodyT");
    }

    #[test]
    fn pieces_of_one_split_merge_back() {
        let a = alloc(1);
        let m = agg(&a, b"0123456789");
        let (h, t) = m.split_at(4).unwrap();
        let j = h.clone().join(t.clone());
        assert_eq!((j.fragments().len(), j.fragments().next().unwrap().range()), (1, 0..10));
        let mut p = t.clone();
        p.prepend(h.clone());
        assert_eq!((p.fragments().len(), p.to_vec()), (1, b"0123456789".to_vec()));
        // Not adjacent (the other order, or a gap): two fragments.
        assert_eq!(t.clone().join(h.clone()).fragments().len(), 2);
        assert_eq!(h.slice(0..3).unwrap().join(t.clone()).fragments().len(), 2);
    }

    #[test]
    fn front_cuts_move_fragments_and_merge() {
        let a = alloc(3);
        let m = agg(&a, b"abc").join(agg(&a, b"defg"));
        for at in 0..=7 {
            // split_to: the front taken, the rest kept.
            let mut rest = m.clone();
            let head = rest.split_to(at).unwrap();
            assert_eq!((head.to_vec(), rest.to_vec()), (b"abcdefg"[..at].to_vec(), b"abcdefg"[at..].to_vec()));
            assert_eq!((head.len(), rest.len()), (at, 7 - at));
            // append_from one byte at a time: the same bytes, fragments merged back.
            let mut src = m.clone();
            let mut dst = agg(&a, b"<");
            for _ in 0..at {
                dst.append_from(&mut src, 1).unwrap();
            }
            assert_eq!(
                (dst.to_vec(), src.to_vec()),
                ([&b"<"[..], &b"abcdefg"[..at]].concat(), b"abcdefg"[at..].to_vec())
            );
            let want = 1 + usize::from(at > 0) + usize::from(at > 3);
            assert_eq!(dst.fragments().len(), want, "at {at}");
            assert!(src.fragments().all(|f| !f.bytes().is_empty()));
        }
        // Too far: an error, nothing changed.
        let mut src = m.clone();
        let mut dst = Aggregate::new();
        assert_eq!(dst.append_from(&mut src, 8), Err(ErrorKind::BadRange { start: 8, end: 7, len: 7 }.into()));
        assert_eq!(src.split_to(8).unwrap_err(), ErrorKind::BadRange { start: 8, end: 7, len: 7 });
        assert_eq!((src.to_vec(), dst.len()), (b"abcdefg".to_vec(), 0));
        // Every fragment moved away: the buffers go back with their last holder.
        dst.append_from(&mut src, 7).unwrap();
        assert!(src.is_empty() && src.fragments().len() == 0);
        drop((m, src));
        assert_eq!(a.available(), 1);
        drop(dst);
        assert_eq!(a.available(), 3);
    }

    #[test]
    fn split_inside_and_at_boundaries() {
        let a = alloc(2);
        let m = agg(&a, b"abc").join(agg(&a, b"defg"));
        for at in 0..=7 {
            let (h, t) = m.split_at(at).unwrap();
            assert_eq!(h.to_vec(), &b"abcdefg"[..at]);
            assert_eq!(t.to_vec(), &b"abcdefg"[at..]);
            assert_eq!((h.len(), t.len()), (at, 7 - at));
            assert!(h.fragments().chain(t.fragments()).all(|f| !f.bytes().is_empty()));
        }
        let (h, t) = m.split_at(1).unwrap();
        let (hf, tf) = (h.fragments().next().unwrap(), t.fragments().next().unwrap());
        assert!(hf.same_buffer(&tf), "one fragment split in two over the same buffer");
        assert_eq!((hf.range(), tf.range()), (0..1, 1..3));
        assert_eq!(addr(hf.bytes()) + 1, addr(tf.bytes()), "no bytes copied");
        assert_eq!(m.split_at(8).unwrap_err(), ErrorKind::BadRange { start: 8, end: 7, len: 7 });
        let mut m2 = m.clone();
        assert!(m2.split_off(9).is_err());
        assert_eq!(m2.to_vec(), b"abcdefg", "nothing changed on error");
        assert_eq!(m.slice(2..5).unwrap().to_vec(), b"cde");
        assert!(m.slice(5..8).is_err());
    }

    fn addr(b: &[u8]) -> usize {
        b.as_ptr() as usize
    }

    #[test]
    fn clip_and_truncate() {
        let a = alloc(3);
        let m = agg(&a, b"ab").join(agg(&a, b"cde")).join(agg(&a, b"f"));
        for n in 0..=8 {
            let mut f = m.clone();
            f.clip_front(n);
            assert_eq!(f.to_vec(), &b"abcdef"[n.min(6)..]);
            let mut b = m.clone();
            b.clip_back(n);
            assert_eq!(b.to_vec(), &b"abcdef"[..6 - n.min(6)]);
            let mut t = m.clone();
            t.truncate(n);
            assert_eq!(t.to_vec(), &b"abcdef"[..n.min(6)]);
            assert_eq!(t.len(), n.min(6));
        }
    }

    #[test]
    fn read_and_bufread_consume_from_the_front() {
        let a = alloc(3);
        let m = agg(&a, b"ab\n").join(agg(&a, b"cd")).join(agg(&a, b"e\nf"));
        let mut r = m.clone();
        let mut out = [0u8; 4];
        assert_eq!(r.read(&mut out).unwrap(), 4);
        assert_eq!(&out, b"ab\nc");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"de\nf");
        assert!(r.is_empty());
        let lines: Vec<String> = m.clone().lines().map(|l| l.unwrap()).collect();
        assert_eq!(lines, ["ab", "cde", "f"]);
        let mut br = m.clone();
        assert_eq!(br.fill_buf().unwrap(), b"ab\n", "the first fragment in place");
        br.consume(3);
        assert_eq!(br.fill_buf().unwrap(), b"cd");
        drop((m, r, br));
        assert_eq!(a.available(), 3);
    }

    #[test]
    fn fixed_units_borrow_inside_and_copy_across() {
        let a = alloc(3);
        let m = agg(&a, b"abcdef").join(agg(&a, b"ghij"));
        let mut u = m.units(fixed(3));
        let got: Vec<Cow<[u8]>> = u.by_ref().collect();
        assert_eq!(got.iter().map(|c| &c[..]).collect::<Vec<_>>(), [&b"abc"[..], b"def", b"ghi", b"j"]);
        assert!(got.iter().all(|c| matches!(c, Cow::Borrowed(_))));
        assert_eq!(u.copies(), 0);
        let mut u = m.units(fixed(4));
        let got: Vec<Cow<[u8]>> = u.by_ref().collect();
        assert_eq!(got.iter().map(|c| &c[..]).collect::<Vec<_>>(), [&b"abcd"[..], b"efgh", b"ij"]);
        assert!(matches!(got[1], Cow::Owned(_)));
        assert_eq!((u.copies(), u.copied_bytes()), (1, 4));
        // A unit larger than any fragment spans several.
        let m3 = m.clone().join(agg(&a, b"k").slice(0..1).unwrap());
        let mut u = m3.units(fixed(100));
        assert_eq!(u.next().unwrap().as_ref(), b"abcdefghijk");
        assert!(u.next().is_none());
        assert_eq!(u.copies(), 1);
        assert_eq!(Aggregate::new().units(fixed(1)).count(), 0);
    }

    #[test]
    fn delimited_units() {
        let a = alloc(6);
        let m = agg(&a, b"ab\ncd").join(agg(&a, b"e\n\n")).join(agg(&a, b"fg"));
        let mut u = m.units(Unit::Delimited(b'\n'));
        let got: Vec<Vec<u8>> = u.by_ref().map(Cow::into_owned).collect();
        assert_eq!(got, [b"ab\n".to_vec(), b"cde\n".to_vec(), b"\n".to_vec(), b"fg".to_vec()]);
        assert_eq!((u.copies(), u.copied_bytes()), (1, 4));
        // Lines that end where their fragments end are all borrowed.
        let lines = agg(&a, b"ab\n").join(agg(&a, b"cd\ne\n"));
        let mut u = lines.units(Unit::Delimited(b'\n'));
        assert!(u.by_ref().all(|l| matches!(l, Cow::Borrowed(_))));
        assert_eq!(u.copies(), 0);
        drop(lines);
        let m = agg(&a, b"no delimiter");
        assert_eq!(m.units(Unit::Delimited(0)).collect::<Vec<_>>(), [Cow::Borrowed(&b"no delimiter"[..])]);
    }

    /// References a fragment's buffer handle has.
    fn refs(f: &Fragment<'_>) -> usize {
        Arc::strong_count(f.held)
    }

    /// A received train of units holds one reference per buffer, not one
    /// per fragment; a piece taken off its front holds its own.
    #[test]
    fn received_tables_hold_a_reference_per_buffer() {
        use crate::{BindParams, Channel, ChannelSetup, Endpoint, Event, PoolPolicy};
        let t = std::time::Duration::from_secs(10);
        let setup = ChannelSetup { meta_size: crate::MAX_META_SIZE, queue_depth: 64, ..ChannelSetup::default() };
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let ep = Endpoint::local();
        let mut tx = Channel::create(&a, &ep, setup).unwrap();
        let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
        tx.wait_connected(t).unwrap();
        rx.wait_connected(t).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        let alloc = Allocator::new(&a, 2, 64 << 10, PoolConstraints::default()).unwrap();
        tx.assign_pool(alloc.pool()).unwrap();
        rx.poll();
        assert!(matches!(tx.wait(Some(t)), Ok(Event::PoolAssigned(_))));
        // 16 units of 4 KiB, each behind a 16-byte header: 32 fragments of 2 buffers.
        let (mut body, mut hdrs) = (Aggregate::from(alloc.alloc().unwrap()), Aggregate::from(alloc.alloc().unwrap()));
        let mut train = Aggregate::new();
        for _ in 0..16 {
            train.append_from(&mut hdrs, 16).unwrap();
            train.append_from(&mut body, 4096).unwrap();
        }
        drop((body, hdrs));
        let want: Vec<_> = train.fragments().map(|f| (f.buffer_id(), f.range())).collect();
        tx.send_aggregate(train, b"m").unwrap();
        let mut got = match rx.wait(Some(t)) {
            Ok(Event::Aggregate { agg, .. }) => agg,
            other => panic!("{other:?}"),
        };
        assert_eq!(got.fragments().map(|f| (f.buffer_id(), f.range())).collect::<Vec<_>>(), want);
        assert!(got.fragments().all(|f| refs(&f) == 1), "one reference per buffer");
        let head = got.split_to(16 + 100).unwrap();
        assert!(head.fragments().chain(got.fragments()).all(|f| refs(&f) == 2));
    }

    #[test]
    fn aggregates_are_send_and_sync() {
        fn is<T: Send + Sync>() {}
        is::<Aggregate>();
    }

    #[cfg(feature = "bytes")]
    #[test]
    fn bytes_buf() {
        use bytes::Buf;
        let a = alloc(2);
        let mut m = agg(&a, b"abc").join(agg(&a, b"de"));
        let mut io = [io::IoSlice::new(&[]); 4];
        assert_eq!(m.chunks_vectored(&mut io), 2);
        assert_eq!((&*io[0], &*io[1]), (&b"abc"[..], &b"de"[..]));
        assert_eq!(m.chunk(), b"abc");
        m.advance(2);
        assert_eq!(m.get_u8(), b'c');
        assert_eq!(m.remaining(), 2);
        assert_eq!(m.copy_to_bytes(2).as_ref(), b"de");
        m.advance(10);
        assert_eq!(m.chunk(), b"");
    }
}
