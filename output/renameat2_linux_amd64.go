package output

// sysRenameat2 is renameat2's system call number (the syscall package
// names it on arm64 only).
const sysRenameat2 = 316
