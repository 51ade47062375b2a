#pragma once
// The check every entry point that takes a file or folder path makes before using it, the
// temporary file a replacement is first written to, and the folder sync that makes a file
// renamed into place survive a crash.

#include <string>
#include <string_view>

namespace tensormem::io {

/// Refuses a path that would name no file, or another file than the one given: an empty
/// path, and a path holding a NUL byte (the system reads a path up to its first NUL, so
/// "a\0b" would name "a"). Throws std::invalid_argument "<who>: ...".
void check_path_argument(std::string_view who, std::string_view path);

/// Creates a new file beside `target` (in its folder), for a replacement written before it is
/// renamed onto `target`. Where the folder's file system can (O_TMPFILE, with /proc/self/fd to
/// link it by), the file has no name until `name_temporary`: a process killed while writing
/// it leaves nothing behind. Elsewhere (NFS, a system without /proc) it is named at once:
/// `<target>.tensormem-tmp.<pid>.<n>` (a short hidden name `.tensormem-tmp.<pid>.<n>` in the
/// same folder where the target's name leaves no room for the suffix), opened write-only with
/// O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC and `mode`, so nothing already there (a user's
/// file, a link, a device, another writer's temporary file) is opened or changed. Returns the
/// descriptor and sets `temp` to its name (empty while it has none), or returns -1 with errno
/// (EEXIST after a hundred names found taken), `temp` naming the last name tried.
int create_temporary_beside(const std::string& target, std::string& temp, unsigned mode);
/// Gives the file `create_temporary_beside` made a name (a hard link, under the names above,
/// passing over those taken: nothing there is opened or changed), once it is written and
/// synced, to be renamed onto `target`; does nothing where `temp` names it already. Where the
/// file system cannot link it (unnamed files but no hard links), its bytes are copied into a
/// new file of that name, with its permission bits, and synced. Returns 0 and sets `temp`, or
/// -1 with errno (nothing named left behind).
int name_temporary(int fd, const std::string& target, std::string& temp);
/// The temporary file in messages: its name, or "<target> (its new file, not yet named)".
std::string temporary_in_messages(const std::string& target, const std::string& temp);

/// Syncs the folder that holds `path` (the current folder when the path names none), so that
/// a rename into it survives a crash. Throws std::system_error "<who>: cannot sync the
/// folder '<folder>' of <path>: <reason>".
void sync_folder_of(std::string_view who, const std::string& path);
/// The folder `sync_folder_of` syncs, and the sync itself, apart: a caller that must not fail
/// once its file is renamed into place (for want of memory) names the folder before the rename.
/// `sync_folder` allocates only for its error.
std::string folder_of(const std::string& path);
void sync_folder(std::string_view who, const std::string& folder, const std::string& path);

namespace detail {
/// Whether `create_temporary_beside` may make a file without a name (the default); off, it
/// names every file at once, as where the file system has no O_TMPFILE. Returns the setting
/// it replaces. For tests of that path.
bool allow_unnamed_temporaries(bool allowed) noexcept;
/// The setting itself (the tensor swapper's own files follow it too).
bool unnamed_temporaries_allowed() noexcept;
/// Copies all of `from` (from its start; open for reading) to `to` (empty, open for writing),
/// continuing short and interrupted transfers: copy_file_range where the file system can,
/// pread and pwrite through a 1 MiB buffer where it cannot. Returns 0, or -1 with errno.
int copy_whole_file(int from, int to) noexcept;
}  // namespace detail

}  // namespace tensormem::io
