//! The macros that write the exported functions.

/// A function and its `p` twin: `$pname` does the work, `$name` calls it.
macro_rules! nccl_fn {
    ($doc:literal $name:ident $pname:ident ($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
        #[doc = $doc]
        #[no_mangle]
        pub unsafe extern "C" fn $pname($($arg: $ty),*) -> $ret $body

        #[doc = $doc]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: the same contract, passed on.
            unsafe { $pname($($arg),*) }
        }
    };
}

/// A function oxccl does not implement: `ncclInvalidUsage`, naming it.
macro_rules! not_implemented {
    ($name:ident $pname:ident ($($arg:ident: $ty:ty),*)) => {
        nccl_fn!("Not implemented by oxccl: fails with `ncclInvalidUsage`, naming itself."
            $name $pname ($($arg: $ty),*) -> $crate::abi::NcclResult {
            let _ = ($($arg,)*);
            $crate::status::run(stringify!($name), || {
                Err($crate::status::not_implemented(stringify!($name)))
            })
        });
    };
}
