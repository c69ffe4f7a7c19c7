//! Unit tests of the primitives: node layouts, deadlines shared by sub-contexts.

use super::*;

#[test]
fn node_layouts_of_equal_and_different_sizes() {
    let even = NodeLayout::new(&["a", "b", "a", "b"], 2).unwrap();
    assert_eq!(even.ranks, vec![vec![0, 2], vec![1, 3]]);
    assert_eq!(
        (even.node, even.local, even.pieces, even.even),
        (0, 1, 2, true)
    );
    assert_eq!(even.cross_group, vec![2, 3]);
    assert!(even.balanced());
    // 4 + 3: local rank 3 of node a carries no piece, so it is in no cross ring.
    let nodes = ["a", "a", "a", "a", "b", "b", "b"];
    let extra = NodeLayout::new(&nodes, 3).unwrap();
    assert_eq!((extra.pieces, extra.even, extra.local), (3, false, 3));
    assert!(extra.cross_group.is_empty());
    assert_eq!(NodeLayout::new(&nodes, 5).unwrap().cross_group, vec![1, 5]);
    assert!(extra.balanced());
    // 2 + 5: allowed (OXCCL_ALGO), but the tuner leaves it flat.
    let skewed = ["a", "a", "b", "b", "b", "b", "b"];
    assert!(!NodeLayout::new(&skewed, 0).unwrap().balanced());
    // No layout: one node, or a node with a single rank.
    assert_eq!(NodeLayout::new(&["a", "a", "a"], 0), None);
    assert_eq!(NodeLayout::new(&["a", "a", "b"], 0), None);
}

/// A deadline first set inside a sub-context is the whole operation's: the parent and later
/// sub-contexts (nested ones too) keep it instead of starting a fresh one.
#[test]
fn sub_contexts_share_the_operation_deadline() {
    let mut links = Links::default();
    let abort = AtomicBool::new(false);
    let timeout = Duration::from_secs(3600);
    let mut ctx = Ctx::new(0, 1, &mut links, Tag::default(), "t", timeout, &abort);
    let members = [0usize];
    {
        let mut s = ctx.sub(&members);
        s.idle(&String::new).unwrap();
        assert!(s.deadline.is_some());
    }
    let d = ctx.deadline;
    assert!(
        d.is_some(),
        "the parent keeps the deadline its sub-context set"
    );
    {
        let mut s = ctx.sub(&members);
        assert_eq!(s.deadline, d);
        s.idle(&String::new).unwrap();
        assert_eq!(s.deadline, d);
    }
    // Nested, with the deadline first set in the innermost context.
    let mut links = Links::default();
    let mut ctx = Ctx::new(0, 1, &mut links, Tag::default(), "t", timeout, &abort);
    {
        let mut s = ctx.sub(&members);
        {
            let mut s2 = s.sub(&members);
            s2.idle(&String::new).unwrap();
        }
        let inner = s.deadline(Instant::now());
        assert_eq!(s.root_deadline.as_deref().copied().flatten(), Some(inner));
    }
    let d = ctx.deadline.expect("set by the innermost context");
    assert_eq!(ctx.deadline(Instant::now() + timeout), d);
}
